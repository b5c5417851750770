"""`areal-service launch --scheduler slurm`: an sbatch script that runs the service on N
nodes, written next to the resolved config, and submitted with `--submit`.

Inside the job (see `launcher/placement.py` for who goes where):
1. one `areal-service engine` per rollout node (`srun`), which launches and supervises
   that node's SGLang servers (or the local engine), bound to that node's address (not
   0.0.0.0: the engine API has no authentication);
2. the script waits until every backend answers `/health_generate`;
3. the gateway on node 0, bound to all interfaces, routing to every backend;
4. the trainer under torchrun on the trainer nodes, rendezvous on the first of them
   (c10d, `$SLURM_JOB_ID` as the id). The job ends when the trainer does
   (`trainer.total_steps`) or at the time limit; the EXIT trap stops the other steps.

Assumes what multi-node Slurm sites provide: a shared filesystem for `data_dir` (the
trainer publishes weights there and the servers load them), the same interpreter path
on every node, `curl`, and Slurm >= 22.05 (`srun --overlap` lets the gateway and the
engines share node 0). With more than one node the store should be PostgreSQL
(`store.url`): SQLite on a network filesystem is neither safe nor fast.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from pathlib import Path

from areal_service.config import ServiceConfig
from launcher.placement import Placement, plan

log = logging.getLogger(__name__)

ENGINE_READY_TIMEOUT_S = 1800
"""How long the script waits for every backend (weights from a cold network disk)."""


def _q(value: object) -> str:
    return shlex.quote(str(value))


def sbatch_script(config: ServiceConfig, config_path: Path) -> str:
    """The sbatch script for `config` (already saved, with an absolute data_dir, at
    `config_path`). Pure: no file or Slurm access, so it can be checked in tests."""
    cl, sl = config.cluster, config.cluster.slurm
    place: Placement = plan(config)
    py = sl.python or sys.executable
    logs = config.data_dir / "logs"
    gw_port = config.gateway.port
    n_roll, n_train = len(place.rollout_nodes), len(place.trainer_nodes)
    trainer_start = place.trainer_nodes[0]
    gpus = ",".join(str(g) for g in place.engine_gpus)
    # Engines have no authentication: each binds to the one address the gateway (and
    # the trainer) reach it at (its node's name as resolved here), never to every
    # interface. Firewall the engine ports to the job's nodes on a shared network.
    engine_sets = ['--set "engine.host=$ENGINE_IP"']
    if config.engine.backend == "sglang":
        engine_sets.append(f"--set {_q(f'engine.sglang.gpus=[{gpus}]')}")
    else:
        engine_sets.append(f"--set engine.port={place.engine_ports[0]}")

    head = [
        "#!/bin/bash",
        f"# Written by `areal-service launch --scheduler slurm` for {config_path}.",
        f"# Layout: {cl.n_nodes} node(s); engines on node(s) "
        f"{','.join(map(str, place.rollout_nodes))} ({len(place.engine_ports)} "
        f"{config.engine.backend} server(s) per node, {place.gpus_per_server} GPU(s) each), "
        f"gateway on node 0 port {gw_port}, trainer on node(s) "
        f"{','.join(map(str, place.trainer_nodes))} ({place.trainer_procs_per_node} "
        "process(es) per node).",
        f"#SBATCH --job-name={sl.job_name}",
        f"#SBATCH --nodes={cl.n_nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --exclusive",
        f"#SBATCH --output={logs}/slurm-%j.out",
    ]
    if cl.n_gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={cl.n_gpus_per_node}")
    head += [f"#SBATCH --partition={sl.partition}"] if sl.partition else []
    head += [f"#SBATCH --account={sl.account}"] if sl.account else []
    head += [f"#SBATCH --time={sl.time}"] if sl.time else []
    head += [f"#SBATCH {arg}" for arg in sl.sbatch_args]
    if cl.n_nodes > 1 and config.database_url().startswith("sqlite"):
        head.append("# WARNING: SQLite store on several nodes; set store.url to PostgreSQL.")

    ports = " ".join(str(p) for p in place.engine_ports)
    trainer_gpus = ",".join(str(g) for g in place.trainer_gpus)
    # One node: both steps see every GPU of the node and each takes its share; trainer
    # nodes of their own give the trainer every GPU of its step.
    trainer_env = (
        f"env CUDA_VISIBLE_DEVICES={trainer_gpus} "
        if place.trainer_gpus and cl.n_nodes == 1
        else ""
    )
    gpu_step = f" --gpus-per-node={cl.n_gpus_per_node}" if cl.n_gpus_per_node else ""
    body = [
        "set -euo pipefail",
        "",
        *sl.setup,
        f"PY={_q(py)}",
        f"CONFIG={_q(config_path)}",
        f"LOGS={_q(logs)}",
        'mkdir -p "$LOGS"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'HEAD_NODE="${NODES[0]}"',
        f'ROLLOUT_NODES=("${{NODES[@]:0:{n_roll}}}")',
        f'TRAINER_NODES=("${{NODES[@]:{trainer_start}:{n_train}}}")',
        'TRAINER_HEAD="${TRAINER_NODES[0]}"',
        "",
        "# Every backend URL is known up front: engine ports are fixed per node.",
        "BACKENDS=()",
        'for node in "${ROLLOUT_NODES[@]}"; do',
        f'  for port in {ports}; do BACKENDS+=("http://$node:$port"); done',
        "done",
        'BACKENDS_JSON="[$(printf \'"%s",\' "${BACKENDS[@]}" | sed \'s/,$//\')]"',
        "",
        "STEPS=()",
        "cleanup() {",
        '  for pid in "${STEPS[@]}"; do kill "$pid" 2>/dev/null || true; done',
        "  wait || true",
        "}",
        "trap cleanup EXIT",
        "",
        "wait_healthy() {  # URL TIMEOUT_S",
        "  local deadline=$((SECONDS + $2))",
        '  until curl -sf -o /dev/null --max-time 30 "$1"; do',
        '    if (( SECONDS > deadline )); then echo "not healthy: $1" >&2; return 1; fi',
        "    sleep 5",
        "  done",
        "}",
        "",
        "# 1. engines: one supervisor per rollout node (restarts a server that dies),",
        "#    bound to the node's address as the gateway resolves it (engines have no",
        "#    authentication: not to every interface)",
        'for node in "${ROLLOUT_NODES[@]}"; do',
        '  ENGINE_IP="$(getent ahostsv4 "$node" | awk \'NR==1 {print $1}\')"',
        '  if [[ -z "$ENGINE_IP" ]]; then echo "cannot resolve $node" >&2; exit 1; fi',
        f'  srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap{gpu_step} \\',
        f'    "$PY" -m launcher engine --config "$CONFIG" {" ".join(engine_sets)} \\',
        '    > "$LOGS/engines-$node.log" 2>&1 &',
        "  STEPS+=($!)",
        "done",
        f'for url in "${{BACKENDS[@]}}"; do wait_healthy "$url/health_generate" '
        f"{ENGINE_READY_TIMEOUT_S}; done",
        "",
        "# 2. the gateway on node 0, routing to every backend",
        'srun --nodes=1 --ntasks=1 --nodelist="$HEAD_NODE" --overlap \\',
        '  "$PY" -m launcher serve --config "$CONFIG" --set gateway.host=0.0.0.0 \\',
        '  --set "gateway.router.backends=$BACKENDS_JSON" > "$LOGS/gateway.log" 2>&1 &',
        "STEPS+=($!)",
        f'wait_healthy "http://$HEAD_NODE:{gw_port}/health/liveness" 300',
        f'echo "gateway: http://$HEAD_NODE:{gw_port}/v1"',
        "",
        "# 3. the trainer: torchrun on each trainer node, c10d rendezvous on the first",
        f"srun --nodes={n_train} --ntasks-per-node=1 "
        f'--nodelist="$(IFS=,; echo "${{TRAINER_NODES[*]}}")" --overlap{gpu_step} \\',
        f'  {trainer_env}"$PY" -m torch.distributed.run --nnodes={n_train} '
        f"--nproc-per-node={place.trainer_procs_per_node} \\",
        f'  --rdzv-backend=c10d --rdzv-endpoint="$TRAINER_HEAD:{sl.rdzv_port}" '
        '--rdzv-id="$SLURM_JOB_ID" \\',
        '  -m trainer.train --config "$CONFIG" --set "gateway.router.backends=$BACKENDS_JSON" \\',
        '  > "$LOGS/trainer.log" 2>&1',
    ]
    return "\n".join([*head, "", *body]) + "\n"


def write_sbatch(config: ServiceConfig, out_dir: Path) -> Path:
    """Save the resolved config (data_dir made absolute) and the script under `out_dir`;
    returns the script's path."""
    from launcher.processes import save_config

    config = config.model_copy(update={"data_dir": config.data_dir.resolve()})
    if config.cluster.n_nodes > 1 and config.database_url().startswith("sqlite"):
        log.warning(
            "SQLite store on %d nodes: set store.url to a PostgreSQL URL", config.cluster.n_nodes
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (config.data_dir / "logs").mkdir(parents=True, exist_ok=True)  # sbatch --output's
    config_path = save_config(config, out_dir.resolve() / "config.yaml")
    script = out_dir / "areal.sbatch"
    script.write_text(sbatch_script(config, config_path))
    return script


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]
