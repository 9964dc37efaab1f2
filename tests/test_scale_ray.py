"""The Ray engine: a local Ray with two worker CPUs, the same shards as the local engine, a killed actor."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason="the Ray engine needs kestrel[ray]")

from kestrel.cli.main import main  # noqa: E402
from kestrel.pipelines.jobs import JobSpec  # noqa: E402
from kestrel.scale import run_job  # noqa: E402
from kestrel.scale.ray_engine import start_ray  # noqa: E402
from reference import features, make_dino, make_photos, table  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    """Ray on this machine with two CPUs (two single-threaded actors), stopped after the module."""
    assert start_ray(num_cpus=2), "a Ray was already running in this process"
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale_ray")
    make_dino(root / "dino")
    return root / "dino", make_photos(root / "photos", n=24)


def data(out):
    t = table(out)
    return t.drop(["features"]), features(t)


def test_ray_two_workers_equal_the_local_engine(local_ray, dataset, tmp_path, capsys):
    model, photos = dataset
    common = ["--model", str(model), "--batch-size", "4", "--shard-size", "8", "--quiet"]
    assert main(["embed", str(photos), "--out", str(tmp_path / "local"), *common]) == 0
    assert main(["embed", str(photos), "--out", str(tmp_path / "ray"), "--engine", "ray", "--workers", "2",
                 *common]) == 0
    assert "wrote 4 shard(s) of 4: 24 rows, 1 unreadable image(s)" in capsys.readouterr().out
    (lt, lf), (rt, rf) = data(tmp_path / "local"), data(tmp_path / "ray")
    assert rt.equals(lt) and np.array_equal(rf, lf)  # row for row, features bit for bit
    assert pq.read_table(tmp_path / "ray" / "failures.parquet").equals(
        pq.read_table(tmp_path / "local" / "failures.parquet"))
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    pids = {int(s["worker"].split(":")[1]) for s in manifest["shards"]}
    assert os.getpid() not in pids  # actors ran the shards (how many of the two did depends on timing)
    # a rerun over the finished folder with the other engine does nothing
    assert main(["embed", str(photos), "--out", str(tmp_path / "ray"), *common]) == 0
    assert "wrote 0 shard(s) of 4, 4 already done" in capsys.readouterr().out


def test_a_killed_worker_loses_no_finished_shard(local_ray, dataset, tmp_path):
    model, photos = dataset
    spec = JobSpec("embed", str(model), batch_size=2)
    killed: dict[str, object] = {}

    def kill_first_worker(shard, result):
        if not killed:
            pid = int(result.worker.split(":")[1])
            os.kill(pid, signal.SIGKILL)  # the actor process that finished this shard
            killed.update(pid=pid, shard=shard.name, stamp=(tmp_path / "ray" / f"{shard.name}.parquet").stat())

    summary = run_job(spec, photos, tmp_path / "ray", engine="ray", workers=2, shard_size=2, progress=False,
                      on_shard=kill_first_worker)
    assert summary.shards == 13 and summary.rows == 24 and summary.failures == 1
    with pytest.raises(ProcessLookupError):
        os.kill(killed["pid"], 0)  # it really died
    after = (tmp_path / "ray" / f"{killed['shard']}.parquet").stat()
    assert after.st_mtime_ns == killed["stamp"].st_mtime_ns and after.st_ino == killed["stamp"].st_ino
    run_job(spec, photos, tmp_path / "local", shard_size=2, progress=False)
    (rt, rf), (lt, lf) = data(tmp_path / "ray"), data(tmp_path / "local")
    assert rt.equals(lt) and np.array_equal(rf, lf)
