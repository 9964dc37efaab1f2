"""Dataset jobs: sources, the local engine's Parquet shards (resume, failures, same numbers as ``kestrel embed``)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from kestrel.cli.main import main
from kestrel.pipelines.datasets import SourceError, plan_shards, read_source
from kestrel.pipelines.jobs import JobSpec
from kestrel.scale import run_job
from kestrel.scale.output import OutputError
from reference import features, make_dino, make_photos, rel_diff, table


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    ref = make_dino(root / "dino")
    return root / "dino", make_photos(root / "photos"), ref








def test_sources_folder_list_csv_parquet(tmp_path):
    photos = make_photos(tmp_path / "p", n=4)
    from_dir = read_source(photos)
    assert [p.split("/")[-1] for p in from_dir] == ["im000.png", "im003.png", "broken.png", "im001.png",
                                                    "im002.png"]
    (tmp_path / "list.txt").write_text("# two images\np/d0/im000.png\n\n" + str(photos / "d1/im001.png") + "\n")
    assert read_source(tmp_path / "list.txt") == [str(tmp_path / "p/d0/im000.png"), str(photos / "d1/im001.png")]
    (tmp_path / "t.csv").write_text("id,file\n1,p/d0/im000.png\n2,p/d2/im002.png\n")
    assert read_source(tmp_path / "t.csv", column="file")[1] == str(tmp_path / "p/d2/im002.png")
    with pytest.raises(SourceError, match=r"t.csv: no column 'path' \(columns: id, file\)"):
        read_source(tmp_path / "t.csv")
    pq.write_table(pa.table({"path": ["p/d0/im000.png"], "label": [3]}), tmp_path / "t.parquet")
    assert read_source([tmp_path / "t.parquet", photos / "d0/im000.png"]) == [str(tmp_path / "p/d0/im000.png"),
                                                                           str(photos / "d0/im000.png")]
    with pytest.raises(SourceError, match="does not exist"):
        read_source(tmp_path / "nope")
    shards = plan_shards([str(k) for k in range(10)], 4)
    assert [len(s.paths) for s in shards] == [4, 4, 2] and shards[2].name == "part-00002"


def test_local_engine_equals_embed_and_resumes(dataset, tmp_path, capsys):
    model, photos, ref = dataset
    single = tmp_path / "feats.safetensors"
    good = [p for p in read_source(photos) if not p.endswith("broken.png")]
    assert main(["embed", *good, "--model", str(model), "--out", str(single), "--batch-size", "4", "--quiet"]) == 0
    out = tmp_path / "shards"
    args = ["embed", str(photos), "--model", str(model), "--out", str(out), "--batch-size", "4", "--shard-size",
            "4", "--quiet"]
    assert main(args) == 0
    assert "wrote 4 shard(s) of 4: 14 rows, 1 unreadable image(s)" in capsys.readouterr().out
    t = table(out)
    with safe_open(single, "pt") as f:
        want, names = f.get_tensor("features"), json.loads(f.metadata()["images"])
    # the broken file shifts the batches after it: the same numbers within 1e-6, not bit for bit
    assert t.column("path").to_pylist() == names
    feats = features(t)
    assert rel_diff(torch.from_numpy(feats), want) <= 1e-6
    # the same images in the same batches (a list file of the good ones): bit for bit
    (tmp_path / "good.txt").write_text("\n".join(good))
    assert main([*args[:1], str(tmp_path / "good.txt"), *args[2:5], str(tmp_path / "good"), *args[6:]]) == 0
    assert np.array_equal(features(table(tmp_path / "good")), want.numpy())
    assert set(t.column("height").to_pylist()) == {32} and set(t.column("model").to_pylist()) == {str(model)}
    assert t.column("revision")[0].as_py().startswith("sha256:")
    failures = pq.read_table(out / "failures.parquet").to_pylist()
    assert [f["path"].split("/")[-1] for f in failures] == ["broken.png"]
    assert "not a recognised image format" in failures[0]["error"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["rows"] == 14 and manifest["failures"] == 1
    assert [s["name"] for s in manifest["shards"]] == [f"part-{k:05d}" for k in range(4)]
    # the reference model agrees too (class token)
    from kestrel.pipelines.images import ImagePreprocess

    pixels = ImagePreprocess.from_file(model)(t.column("path").to_pylist())
    with torch.no_grad():
        assert rel_diff(torch.from_numpy(feats), ref(pixel_values=pixels).last_hidden_state[:, 0]) <= 1e-4

    # resume: a lost shard is redone, the others are not touched
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    (out / "part-00002.parquet").unlink()
    (out / ".part-00002.parquet.x.tmp").write_bytes(b"half a shard from a killed run")
    assert main(args) == 0
    assert "wrote 1 shard(s) of 4, 3 already done" in capsys.readouterr().out
    assert not list(out.glob(".*.tmp"))
    for name, stamp in stamps.items():
        assert ((out / name).stat().st_mtime_ns == stamp) == (name != "part-00002.parquet")
    assert table(out).drop(["features"]).equals(t.drop(["features"])) and np.array_equal(features(table(out)), feats)

    # another job is refused, not mixed in
    assert main([*args[:-1], "--pool", "mean", "--quiet"]) == 2
    assert "holds another job's output: the settings differ" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"non-empty folder without a manifest\.json"):
        run_job(JobSpec("embed", str(model)), photos, tmp_path / "busy", progress=False)


def test_bad_dataset_arguments_are_one_line(dataset, tmp_path, capsys):
    model, photos, _ = dataset
    assert main(["embed", str(tmp_path / "none.csv"), "--model", str(model), "--out", str(tmp_path / "o")]) == 2
    assert "none.csv does not exist" in capsys.readouterr().err
    assert main(["embed", str(photos), "--model", str(model), "--out", str(tmp_path / "o"), "--workers", "2"]) == 2
    assert "--workers need --engine ray" in capsys.readouterr().err
    assert main(["zero-shot", str(photos), "--labels", "cat", "--model", str(model), "--out", str(tmp_path / "z")]) == 2
    assert "zero-shot needs an image-text model" in capsys.readouterr().err and not (tmp_path / "z").exists()
    from kestrel.scale.ray_engine import _user_error

    report = "ray.exceptions.RayTaskError(UserCodeException): ...\nTraceback ...\n" \
             "kestrel.runtime.checkpoint.CheckpointError: model.safetensors is cut short\nUDF failed"
    assert str(_user_error(RuntimeError(report))) == "in a Ray worker: model.safetensors is cut short (CheckpointError)"
    assert _user_error(RuntimeError("ray.exceptions.ActorDiedError: the node died")) is None


def test_zero_shot_dataset_scores_equal_kestrel_zero_shot(siglip_dir, tmp_path):
    from kestrel import load
    from kestrel.pipelines.tasks import preprocess_for
    from kestrel.pipelines.tokenizer import SiglipTextTokenizer
    from kestrel.pipelines.zero_shot import zero_shot

    d, paths, out = siglip_dir
    labels = ["dog", "a red car", "sleeping cat"]
    folder = paths[0].parent
    assert main(["zero-shot", *map(str, paths), "--labels", *labels, "--template", "a photo of {}.", "--model",
                 str(d), "--out", str(tmp_path / "scores"), "--batch-size", "2", "--quiet"]) == 0
    t = table(tmp_path / "scores")
    assert t.column("path").to_pylist() == [str(p) for p in paths] and folder.is_dir()
    scores = torch.from_numpy(np.stack(t.column("scores").to_numpy(zero_copy_only=False)))
    model = load(d)
    tok = SiglipTextTokenizer.from_dir(d, max_length=model.generics["MaxPositions"])
    want = zero_shot(model, paths, labels, tok, preprocess_for(model), "a photo of {}.")
    assert float((scores - want).abs().max()) <= 1e-6
    assert rel_diff(scores, torch.sigmoid(out.logits_per_image)) <= 1e-4
    assert t.column("label").to_pylist() == [labels[k] for k in want.argmax(1).tolist()]
    job = json.loads(t.schema.metadata[b"kestrel.job"])
    assert job["labels"] == labels and job["template"] == "a photo of {}."
