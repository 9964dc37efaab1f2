"""The edge split section of a SAM 2.1 page: seed 002's 512-pixel encoder and decoder programs.

Derived from the program's own entries (``encode_image`` and ``decode_tokens``, bound at ``E = 32``,
one image, one prompt of the decoder's three tokens), the export recipe's prompt tables and stated
differences (``kestrel.export.edge_sam2``), and the checkpoint's card; the file hashes are those the
export writes into its ``manifest.json``, which ``kestrel serve`` and its page check before use.

Given an export folder (``kestrel site --edge DIR``), its files are checked against the manifest's
sha256, copied into the site under ``edge/<card>/`` and linked from that card's page with the
manifest's hashes and ``validation.json``'s results; without one, the page says how to make one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from html import escape
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..blocks import Block
from ..blocks.block import bind_generics
from ..errors import KestrelError
from ..export.manifest import sha256_file
from ..models.cards import Card
from ..shapes.poly import format_poly
from ..types.dtypes import f32
from ..types.tensor import TensorType, TupleType

SPLIT_SIZE = 512  # seed 002's image size: E = 512 / 16
MANIFEST, VALIDATION = "manifest.json", "validation.json"


class EdgeExportError(KestrelError, ValueError):
    """An export folder the site cannot link: no manifest, a listed file missing or not as hashed."""


@dataclass
class EdgeExport:
    """A ``kestrel export`` folder of SAM 2.1's split, read and checked for the site."""

    path: Path
    manifest: dict[str, Any]
    validation: dict[str, Any] | None

    @property
    def repo(self) -> str:
        return str(self.manifest.get("upstream", {}).get("model", ""))

    def files(self) -> list[str]:
        """What the site copies: the listed files, then validation.json and manifest.json."""
        return [*self.manifest["files"], *([VALIDATION] if self.validation is not None else []), MANIFEST]

    def copy_to(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for name in self.files():
            try:  # a hard link where the site is on the same disk: the encoder alone is 100 MB or more
                os.link(self.path / name, out / name)
            except OSError:
                shutil.copyfile(self.path / name, out / name)


def read_edge_export(path: Path) -> EdgeExport:
    """The export at ``path``, every listed file present with the manifest's size and sha256."""
    path = Path(path)
    make = "make one with `kestrel export sam2.1-hiera-tiny --target onnx --size 512 --out DIR`"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise EdgeExportError(f"{path}: no {MANIFEST}; {make}") from None
    except (OSError, ValueError) as e:
        raise EdgeExportError(f"{path / MANIFEST}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise EdgeExportError(f"{path / MANIFEST}: not a SAM 2.1 edge export (no table of files); {make}")
    for name, row in manifest["files"].items():
        f = path / name
        if Path(name).name != name or not f.is_file():
            raise EdgeExportError(f"{path / MANIFEST} lists {name!r}, which is not a file in {path}")
        want = row.get("sha256") if isinstance(row, dict) else None
        if want and sha256_file(f) != want:
            raise EdgeExportError(f"{f}: its sha256 is not the manifest's ({want[:12]}...); export again")
    validation = None
    if (path / VALIDATION).is_file():
        try:
            validation = json.loads((path / VALIDATION).read_text())
        except (OSError, ValueError) as e:
            raise EdgeExportError(f"{path / VALIDATION}: unreadable ({e})") from None
    return EdgeExport(path, manifest, validation if isinstance(validation, dict) else None)


def has_edge_split(card: Card) -> bool:
    """A SAM 2.1 card: its program has the split's two entries."""
    names = {fn.name for fn in card.family.root(card.config).decl().entries}
    return {"encode_image", "decode_tokens"} <= names


def _dims(t: TensorType, dims: dict[str, Any]) -> list[int]:
    bound = t.substitute(dims, {"T": f32})
    return [int(format_poly(d)) for d in bound.dims]


def _items(t: Any) -> list[TensorType]:
    return list(t.items) if isinstance(t, TupleType) else [t]


# the programs' port names, as the export recipe writes them into manifest.json (kestrel.export.edge_sam2)
ENCODER_PORTS = (["pixels"], ["image_embeddings", "hr0", "hr1"])
DECODER_PORTS = (["image_embeddings", "image_pe", "sparse", "dense", "hr0", "hr1"],
                 ["masks", "iou_scores", "object_score_logits"])


def _size(text: str, env: dict[str, int]) -> int:
    """``Hd / 2`` with the generics' values: names, integers and floor divisions, left to right."""
    terms = [t.strip() for t in text.split("/")]
    value = env[terms[0]] if terms[0] in env else int(terms[0])
    for t in terms[1:]:
        value //= env[t] if t in env else int(t)
    return value


def split_programs(root: type[Block], hd: int, e: int, tokens: int) -> list[dict[str, Any]]:
    """The split's two programs from the entries' declared types at one image and one prompt:
    ``{"name", "entry", "inputs": [(port, shape)], "outputs": [(port, shape)]}``. The decoder program
    gives its masks as ``[1, 3, 4E, 4E]`` (the prompt and mask axes joined), as the recipe's wrapper does."""
    decl = root.decl()
    fns = {fn.name: fn for fn in decl.entries}
    dims = {"B": 1, "E": e, "Hd": hd, "Pts": 1, "N": tokens}
    out = []
    for name, entry, (ins, outs) in (("sam2_encoder", "encode_image", ENCODER_PORTS),
                                     ("sam2_decoder", "decode_tokens", DECODER_PORTS)):
        fn = fns[entry]
        in_shapes = [_dims(t, dims) for _, t in fn.params]
        out_shapes = [_dims(t, dims) for t in _items(fn.result)]
        if entry == "decode_tokens":
            b, pts, k, h, w = out_shapes[0]
            out_shapes[0] = [b, pts * k, h, w]
        out.append({"name": name, "entry": entry, "inputs": list(zip(ins, in_shapes)),
                    "outputs": list(zip(outs, out_shapes))})
    return out


def _bytes(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _number(x: Any, digits: str = ".2e") -> str:
    return format(x, digits) if isinstance(x, int | float) else "—"


def _linked_files(card: Card, export: EdgeExport) -> str:
    """The export's files as links into the site's copy, with sizes, hashes and validation's results."""
    where = f"../edge/{card.name}/"
    rows = []
    for name, row in export.manifest["files"].items():
        row = row if isinstance(row, dict) else {}
        note = f"<br><small>{escape(str(row['note']))}</small>" if row.get("note") else ""
        rows.append(f'<tr><td><a href="{where}{escape(name)}" download><code>{escape(name)}</code></a>{note}</td>'
                    f"<td>{_bytes(int(row.get('bytes', (export.path / name).stat().st_size)))}</td>"
                    f"<td><code class=\"hash\">{escape(str(row.get('sha256', '')))}</code></td></tr>")
    extra = f'<a href="{where}{MANIFEST}"><code>{MANIFEST}</code></a>'
    if export.validation is not None:
        extra += f' · <a href="{where}{VALIDATION}"><code>{VALIDATION}</code></a>'
    up = export.manifest.get("upstream", {})
    html = [f'<p class="edge-built">This site was built with an export, '
            f"“{escape(str(export.manifest.get('model', '')))}”, of <code>{escape(export.repo)}</code> at revision "
            f"<code>{escape(str(up.get('revision', '?'))[:12])}</code>: {extra}.</p>",
            '<table class="edge-files"><thead><tr><th>File</th><th>Size</th><th>sha256</th></tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>"]
    v = export.validation
    if v is not None:
        summary = v.get("summary", {})
        tol = summary.get("tolerance", {})
        verdict = ("passed" if summary.get("passed") else "FAILED") if "passed" in summary else "not summarised"
        count = summary.get("cases", "?")
        html.append(f'<p class="edge-validation"><strong>Validation {verdict}</strong>: {count} '
                    f"case{'' if count == 1 else 's'}, worst relative error {_number(summary.get('worst_relative'))} "
                    f"(bound {_number(tol.get('relative'))}), lowest mask IoU "
                    f"{_number(summary.get('lowest_mask_iou'), '.4f')} "
                    f"(bound {_number(tol.get('mask_iou'), '.2f')}).</p>")
        cases = []
        for c in v.get("cases", []):
            outs = c.get("outputs", {}).values()
            rel = max((o["relative"] for o in outs if isinstance(o.get("relative"), int | float)), default=None)
            iou = min((o["mask_iou"] for o in outs if isinstance(o.get("mask_iou"), int | float)), default=None)
            cases.append(f"<tr><td><code>{escape(str(c.get('program', '')))}</code></td>"
                         f"<td>{escape(str(c.get('sample', '')))}</td><td>{escape(str(c.get('reference', '')))}</td>"
                         f"<td>{_number(rel)}</td><td>{_number(iou, '.4f')}</td></tr>")
        html.append('<details><summary>Every validation case</summary><table class="edge-cases"><thead><tr>'
                    "<th>Program</th><th>Sample</th><th>Reference</th><th>Relative error</th><th>Mask IoU</th>"
                    f"</tr></thead><tbody>{''.join(cases)}</tbody></table></details>")
    html.append(f'<p>The copy is a whole export: <code>kestrel serve --export site/edge/{card.name}/</code> '
                "serves it (for a site built with the default <code>--out site</code>).</p>")
    return "\n".join(html)


def edge_section(card: Card, root: type[Block], export: EdgeExport | None = None) -> str:
    from ..export.edge_sam2 import TABLE_SHAPES, TOKENS, Sam2Recipe
    decl = root.decl()
    e = SPLIT_SIZE // 16
    bound = bind_generics(decl, card.generics())
    hd = int(bound["Hd"])
    rows = []
    for program in split_programs(root, hd, e, TOKENS):
        ports = [", ".join(f"<code>{escape(n)} {shape}</code>" for n, shape in program[k])
                 for k in ("inputs", "outputs")]
        rows.append(f"<tr><td><code>{program['name']}</code></td><td><code>{program['entry']}</code></td>"
                    f"<td>{ports[0]}</td><td>{ports[1]}</td></tr>")
    env = {"Hd": hd, "E": e}
    tables = []
    for name, shape in TABLE_SHAPES.items():
        values = [_size(part, env) for part in shape.split(",")]
        tables.append(f"<tr><td><code>{name}</code></td><td><code>[{', '.join(map(str, values))}]</code></td>"
                      f"<td><code>[{escape(shape)}]</code></td></tr>")
    recipe = Sam2Recipe(SimpleNamespace(generics={"E": e, "Hd": hd}, loaded=None), tokens=TOKENS)
    differences = "".join(f"<li>{escape(d)}</li>" for d in recipe.differences)
    export_cmd = f"kestrel export {card.name} --target onnx --size {SPLIT_SIZE} --out edge/"
    if export is not None:
        linked = _linked_files(card, export)
    else:
        linked = ('<p class="edge-absent">This site was built without an export, so there are no files to '
                  "download here. Make them with the command above (the card's weights come from the Hub, or "
                  "give <code>--weights DIR</code>; <code>--target executorch-webgpu</code> writes seed 002's "
                  "<code>.pte</code> programs), then build the site with them to link them on this page:</p>\n"
                  '<pre class="code">kestrel site --edge edge/</pre>')
    return f"""<section id="edge-split">
<h2>Edge split at {SPLIT_SIZE} px</h2>
<p>Seed 002's split of this model for the browser and ExecuTorch's WebGPU partitioner: an encoder program run
once per image and a small decoder program run on every click, bound at <code>E = {e}</code>
({SPLIT_SIZE} x {SPLIT_SIZE} pixels, masks {4 * e} x {4 * e}), one image and one prompt of {TOKENS} tokens.</p>
<h3>The two programs</h3>
<table class="edge-programs"><thead><tr><th>Program</th><th>Entry</th><th>Inputs</th><th>Outputs</th></tr></thead>
<tbody>{''.join(rows)}</tbody></table>
<p>Preprocessing outside the graph: {escape(recipe.preprocessing)}.</p>
<h3>Prompt tables</h3>
<p>Little-endian f32 files a page composes the decoder's sparse tokens from (points, box corners, the
not-a-point pad), with the image positions and the dense (no mask) embedding:</p>
<table class="edge-tables"><thead><tr><th>File</th><th>Shape</th><th>In the model's generics</th></tr></thead>
<tbody>{''.join(tables)}</tbody></table>
<h3>Differences from the upstream pipeline</h3>
<ul>{differences}</ul>
<h3 id="edge-files">Files, hashes and validation</h3>
<p>The export writes <code>sam2_encoder</code> and <code>sam2_decoder</code> (<code>.onnx</code>, or
<code>.pte</code> for ExecuTorch with <code>*_portable.pte</code> CPU twins), the prompt tables above,
<code>manifest.json</code> (upstream <code>{escape(card.repo)}</code> at revision
<code>{escape(card.revision[:12])}</code>, versions, the programs' named inputs and outputs, the graph
rewrites applied, and every file's size and sha256) and <code>validation.json</code>: each program run on
this CPU against Kestrel eager and transformers at the same size (max |diff| relative to the largest
reference value within 1e-4, mask IoU at least 0.99; the command exits 1 when a bound fails).</p>
<pre class="code">{escape(export_cmd)}
ls edge/   # manifest.json  validation.json  sam2_encoder.onnx  sam2_decoder.onnx  prompt_*.bin</pre>
{linked}
<h3>Segment in the browser: <code>kestrel serve</code></h3>
<p>A local page (loopback only) that checks every exported file against the manifest's sha256, encodes each
image once (in the page with onnxruntime-web, WebGPU or WASM, or on the server with
<code>--encode server</code>) and decodes every click, shift-click or dragged box in the page:</p>
<pre class="code">kestrel serve --export edge/                 # then open http://127.0.0.1:8765/
kestrel serve --model DIR --encode server    # export DIR once, encode on this machine</pre>
</section>"""


__all__ = ["SPLIT_SIZE", "EdgeExport", "EdgeExportError", "edge_section", "has_edge_split", "read_edge_export",
           "split_programs"]
