"""Slurm launcher: the sbatch script for a 3-node example (content, `bash -n`), what it
runs when executed against stand-in `scontrol`/`srun`/`curl`, the single-node GPU
split, and the placement errors."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from areal_service.config import load_config
from launcher.placement import plan
from launcher.slurm import sbatch_script, write_sbatch

THREE_NODES = [
    "engine.backend=sglang",
    "engine.model=/shared/ckpt/qwen3-1.7b",
    "engine.sglang.tp_size=2",
    "cluster.n_nodes=3",
    "cluster.n_gpus_per_node=8",
    "cluster.slurm.partition=gpu",
    "cluster.slurm.time=12:00:00",
    "cluster.slurm.python=/shared/venv/bin/python",
    "cluster.slurm.setup=['module load cuda/12.4']",
    "cluster.slurm.sbatch_args=['--qos=high']",
    "store.url=postgresql+psycopg://areal@db/areal",
]


def _three_nodes(tmp_path: Path):
    return load_config(None, [*THREE_NODES, f"data_dir={tmp_path / 'run'}"])


def test_three_node_placement():
    p = plan(load_config(None, THREE_NODES))
    assert p.rollout_nodes == (0, 1) and p.trainer_nodes == (2,)
    assert p.engine_ports == (30000, 30001, 30002, 30003) and p.gpus_per_server == 2
    assert p.n_servers == 8 and p.trainer_procs_per_node == 8


@pytest.mark.processes
def test_three_node_script_content_and_syntax(tmp_path):
    script = write_sbatch(_three_nodes(tmp_path), tmp_path / "launch")
    text = script.read_text()
    saved = yaml.safe_load((tmp_path / "launch" / "config.yaml").read_text())
    assert saved["data_dir"] == str((tmp_path / "run").resolve())  # absolute for every node
    assert (tmp_path / "run" / "logs").is_dir()  # sbatch --output needs it to exist
    for line in [
        "#SBATCH --nodes=3",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=12:00:00",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
        f"#SBATCH --output={(tmp_path / 'run').resolve()}/logs/slurm-%j.out",
        "module load cuda/12.4",
        "PY=/shared/venv/bin/python",
        f"CONFIG={(tmp_path / 'launch' / 'config.yaml').resolve()}",
        'ROLLOUT_NODES=("${NODES[@]:0:2}")',
        'TRAINER_NODES=("${NODES[@]:2:1}")',
        '  for port in 30000 30001 30002 30003; do BACKENDS+=("http://$node:$port"); done',
    ]:
        assert line in text.splitlines(), line
    assert "--set 'engine.sglang.gpus=[0,1,2,3,4,5,6,7]'" in text
    assert "--nnodes=1 --nproc-per-node=8" in text and "--rdzv-backend=c10d" in text
    assert '--rdzv-endpoint="$TRAINER_HEAD:29500" --rdzv-id="$SLURM_JOB_ID"' in text
    assert "WARNING" not in text  # PostgreSQL store
    assert (
        text.index("launcher engine") < text.index("launcher serve") < text.index("trainer.train")
    )
    subprocess.run(["bash", "-n", str(script)], check=True)


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.processes
def test_script_runs_each_step_on_the_right_nodes(tmp_path):
    """Executed with stand-ins: scontrol names three nodes, srun and curl log and
    succeed. The steps, their nodes and the backends JSON are what a real job gets."""
    script = write_sbatch(_three_nodes(tmp_path), tmp_path / "launch")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", 'printf "gpu-a\\ngpu-b\\ngpu-c\\n"\n')
    # The trainer step (foreground, last) waits until the three background steps logged
    # themselves: the EXIT trap would otherwise kill a stand-in that had not run yet.
    _stub(
        bin_dir,
        "srun",
        f"""
if [[ "$*" == *trainer.train* ]]; then
  for _ in $(seq 100); do (( $(grep -c ^srun {calls}) >= 3 )) && break; sleep 0.1; done
fi
printf "srun %s\\n" "$*" >> {calls}
""",
    )
    _stub(bin_dir, "curl", f'printf "curl %s\\n" "$*" >> {calls}\n')
    _stub(bin_dir, "module", "true\n")
    _stub(
        bin_dir,
        "getent",
        'case "$2" in gpu-a) n=1;; gpu-b) n=2;; *) n=3;; esac\n'
        'printf "10.0.0.%s STREAM %s\\n10.0.0.%s DGRAM\\n" "$n" "$2" "$n"\n',
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-[a-c]",
        "SLURM_JOB_ID": "4242",
    }
    text = script.read_text().replace("module load cuda/12.4", "module load cuda/12.4 || true")
    runnable = tmp_path / "runnable.sh"
    runnable.write_text(text)
    done = subprocess.run(
        ["bash", str(runnable)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "gateway: http://gpu-a:8000/v1" in done.stdout
    lines = calls.read_text().splitlines()
    sruns = [line for line in lines if line.startswith("srun")]
    backends = [f"http://gpu-{n}:{p}" for n in "ab" for p in range(30000, 30004)]
    assert len(sruns) == 4
    engines = [s for s in sruns if "launcher engine" in s]
    [gateway] = [s for s in sruns if "launcher serve" in s]
    [trainer] = [s for s in sruns if "trainer.train" in s]
    assert sruns[-1] == trainer  # the foreground step, after the gateway answered
    assert {s.split("--nodelist=")[1].split()[0] for s in engines} == {"gpu-a", "gpu-b"}
    assert all("--gpus-per-node=8" in s for s in engines)
    # The unauthenticated engine API binds to its node's address, never to all of them.
    assert {s.split("engine.host=")[1].split()[0] for s in engines} == {"10.0.0.1", "10.0.0.2"}
    assert not any("0.0.0.0" in s for s in engines)
    assert "--nodelist=gpu-a" in gateway
    assert f"gateway.router.backends={json.dumps(backends, separators=(',', ':'))}" in gateway
    assert "--nodelist=gpu-c" in trainer and "--rdzv-endpoint=gpu-c:29500" in trainer
    assert "--rdzv-id=4242" in trainer
    assert f"gateway.router.backends={json.dumps(backends, separators=(',', ':'))}" in trainer
    health = [line for line in lines if line.startswith("curl")]
    assert [h.split()[-1] for h in health] == [
        *[f"{b}/health_generate" for b in backends],
        "http://gpu-a:8000/health/liveness",
    ]
    # the bash-built JSON is what the config loader reads as gateway.router.backends
    cfg = load_config(
        None, [f"gateway.router.backends={json.dumps(backends, separators=(',', ':'))}"]
    )
    assert cfg.gateway.router.backends == backends


@pytest.mark.processes
def test_one_node_splits_its_gpus_between_engines_and_trainer(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.backend=sglang",
            "cluster.n_nodes=1",
            "cluster.trainer_gpus=2",
            f"data_dir={tmp_path}",
        ],
    )
    p = plan(cfg)
    assert p.engine_gpus == (0, 1, 2, 3, 4, 5) and p.trainer_gpus == (6, 7)
    assert p.engine_ports == tuple(range(30000, 30006))
    text = sbatch_script(cfg, tmp_path / "config.yaml")
    assert "--set 'engine.sglang.gpus=[0,1,2,3,4,5]'" in text
    assert 'env CUDA_VISIBLE_DEVICES=6,7 "$PY" -m torch.distributed.run' in text
    assert "--nproc-per-node=2" in text
    script = tmp_path / "one.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_sqlite_on_several_nodes_is_flagged_and_bad_layouts_are_errors(tmp_path):
    cfg = load_config(None, ["engine.backend=sglang", "cluster.n_nodes=2", f"data_dir={tmp_path}"])
    assert "WARNING: SQLite store on several nodes" in sbatch_script(cfg, tmp_path / "c.yaml")
    with pytest.raises(ValueError, match="cannot hold"):
        plan(
            load_config(
                None, ["engine.backend=sglang", "engine.sglang.tp_size=16", "cluster.n_nodes=2"]
            )
        )
    with pytest.raises(ValueError, match="leaves no node"):
        load_config(None, ["cluster.n_nodes=2", "cluster.trainer_nodes=2"])
    cpu = plan(load_config(None, ["cluster.n_nodes=1", "cluster.n_gpus_per_node=0"]))
    assert cpu.engine_ports == (30000,) and cpu.gpus_per_server == 0
    assert cpu.trainer_procs_per_node == 1


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster" / "three_nodes.yaml"


@pytest.mark.processes
def test_launch_command_writes_and_submits_the_example(tmp_path, monkeypatch):
    """`areal-service launch --scheduler slurm --submit` on examples/cluster's example: the
    script lands in --out and sbatch (a stand-in on PATH) is called with it."""
    from typer.testing import CliRunner

    from launcher.cli import app

    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch.log"
    bin_dir.mkdir()
    _stub(bin_dir, "sbatch", f'printf "%s\\n" "$*" >> {calls}\necho "777;cluster"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    out = tmp_path / "launch"
    result = CliRunner().invoke(
        app,
        [
            "launch",
            "--scheduler",
            "slurm",
            "--config",
            str(EXAMPLE),
            "--out",
            str(out),
            "--submit",
            "--set",
            f"data_dir={tmp_path / 'run'}",
        ],
    )
    assert result.exit_code == 0, result.output
    text = (out / "areal.sbatch").read_text()
    assert "#SBATCH --nodes=3" in text and "#SBATCH --time=24:00:00" in text
    assert "--set 'engine.sglang.gpus=[0,1,2,3,4,5,6,7]'" in text
    assert calls.read_text().split() == ["--parsable", str(out / "areal.sbatch")]
    subprocess.run(["bash", "-n", str(out / "areal.sbatch")], check=True)
    bad = CliRunner().invoke(app, ["launch", "--scheduler", "pbs", "--config", str(EXAMPLE)])
    assert bad.exit_code != 0 and "local, ray or slurm" in bad.output
