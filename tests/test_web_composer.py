"""The page's prompt composer (static/composer.js, run by Node.js) against Kestrel's Python composer:
the same prompts give the same tokens, bit for bit."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel.pipelines.sam2_processing import PromptTables, compose

STATIC = Path(__file__).resolve().parents[1] / "src" / "kestrel" / "web" / "static"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed (the page's JavaScript runs on it)")
HD, SIZE = 256, 512

SCRIPT = """
import { composeTokens, fitPrompt, tokenCount } from '%s/composer.js';
import fs from 'fs';
const job = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const table = (name) => new Float32Array(new Uint8Array(fs.readFileSync(`${job.dir}/${name}.bin`)).buffer);
const tables = { gaussian: table('prompt_gaussian'), point_fg: table('prompt_point_embed_fg'),
  point_bg: table('prompt_point_embed_bg'), box_tl: table('prompt_box_tl'), box_br: table('prompt_box_br'),
  not_a_point: table('prompt_not_a_point') };
const results = job.cases.map((c, i) => {
  const prompt = { points: c.points.map(([x, y], k) => ({ x, y, label: c.labels[k] })),
                   box: c.box && { x0: c.box[0], y0: c.box[1], x1: c.box[2], y1: c.box[3] } };
  const fitted = fitPrompt(prompt, c.count);
  const tokens = composeTokens(tables, fitted, c.count, job.size);
  fs.writeFileSync(`${job.dir}/out${i}.f32`, Buffer.from(tokens.buffer));
  return { needed: tokenCount(prompt), kept: fitted.points.length };
});
fs.writeFileSync(`${job.dir}/results.json`, JSON.stringify(results));
"""

CASES = [
    dict(points=[(250.0, 180.0)], labels=[1], count=3),
    dict(points=[(100.25, 60.75)], labels=[0], count=3),
    dict(points=[(250.0, 180.0), (400.5, 420.0)], labels=[1, 0], count=3),
    dict(points=[(0.0, 0.0), (511.9, 511.9)], labels=[0, 1], count=3),
    dict(points=[(-12.0, 600.0)], labels=[1], count=3),                       # out of frame, as upstream allows
    dict(points=[], labels=[], box=(120.0, 90.0, 380.0, 330.0), count=3),
    dict(points=[(210.0, 120.0)], labels=[1], box=(40.0, 30.0, 380.0, 260.0), count=4),
    dict(points=[(1.0, 2.0), (3.0, 4.0), (5.0, 6.0)], labels=[1, 1, 0], count=5),   # padded by one
    dict(points=[(10.0, 20.0)], labels=[1], count=8),                                # padded by six
    dict(points=[(210.0, 120.0), (30.0, 40.0)], labels=[1, 0], box=(40.0, 30.0, 380.0, 260.0), count=5),
]


def random_tables(seed: int = 0) -> PromptTables:
    g = torch.Generator().manual_seed(seed)
    vec = [torch.randn(HD, generator=g) for _ in range(5)]
    return PromptTables(gaussian=torch.randn(2, HD // 2, generator=g) * 3, point_embed_bg=vec[0],
                        point_embed_fg=vec[1], box_tl=vec[2], box_br=vec[3], not_a_point=vec[4], image_size=SIZE)


def run_js(tmp_path: Path, tables: PromptTables, cases: list[dict]) -> tuple[list[np.ndarray], list[dict]]:
    for name, t in tables.as_files().items():
        (tmp_path / f"{name}.bin").write_bytes(t.numpy().astype("<f4").tobytes())
    script = tmp_path / "run.mjs"
    script.write_text(SCRIPT % STATIC.as_posix())
    (tmp_path / "job.json").write_text(json.dumps({"dir": str(tmp_path), "size": SIZE, "cases": cases}))
    subprocess.run([NODE, str(script), str(tmp_path / "job.json")], check=True, timeout=60)
    outs = [np.frombuffer((tmp_path / f"out{i}.f32").read_bytes(), "<f4") for i in range(len(cases))]
    return outs, json.loads((tmp_path / "results.json").read_text())


def test_tokens_equal_the_python_composer_bit_for_bit(tmp_path):
    tables = random_tables()
    outs, _ = run_js(tmp_path, tables, CASES)
    for case, got in zip(CASES, outs):
        want = compose(tables, case["points"], case["labels"], case.get("box"), count=case["count"])
        want = want.numpy().reshape(-1)
        assert got.shape == want.shape
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (case, np.abs(got - want).max())


def test_random_prompts_bit_for_bit(tmp_path):
    rng = np.random.default_rng(3)
    cases = []
    for _ in range(40):
        n = int(rng.integers(0, 3))
        box = None if n and rng.random() < 0.5 else tuple(sorted(rng.uniform(-20, 540, 2))) * 2
        if box is not None:
            box = (box[0], box[2], box[1], box[3])
        points = [tuple(float(v) for v in rng.uniform(-20, 540, 2)) for _ in range(n)]
        count = n + (3 if box else 1) + int(rng.integers(0, 3))
        cases.append(dict(points=points, labels=[int(v) for v in rng.integers(0, 2, n)], box=box, count=count))
    tables = random_tables(1)
    outs, _ = run_js(tmp_path, tables, cases)
    for case, got in zip(cases, outs):
        want = compose(tables, case["points"], case["labels"], case["box"], count=case["count"]).numpy().reshape(-1)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), case


def test_a_prompt_larger_than_the_decoder_keeps_the_box_and_the_latest_points(tmp_path):
    tables = random_tables()
    big = dict(points=[(1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0)], labels=[1, 0, 1, 1], count=3)
    with_box = dict(points=[(5.0, 5.0)], labels=[1], box=(0.0, 0.0, 9.0, 9.0), count=3)
    outs, results = run_js(tmp_path, tables, [big, with_box])
    assert results == [{"needed": 5, "kept": 2}, {"needed": 4, "kept": 0}]
    latest = compose(tables, big["points"][-2:], big["labels"][-2:], count=3).numpy().reshape(-1)
    assert np.array_equal(outs[0], latest)
    box_only = compose(tables, box=with_box["box"], count=3).numpy().reshape(-1)
    assert np.array_equal(outs[1], box_only)
