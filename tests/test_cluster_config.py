"""The cluster/ settings checked against the real tools: Ray's cluster-config schema and
preparation (cluster/ray-cluster.yaml), three real nats-server processes from the NATS template
(cluster/nats-cluster.conf), and a real Spark standalone master and worker with
cluster/spark-defaults.conf."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import string
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from runtime.nats.server import PORT_ATTEMPTS, connect, free_ports, nats_server_binary, taken_ports
from runtime.waiting import await_until, wait_until

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"


# --------------------------------------------------------------------------- ray cluster YAML


def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.unit
def test_ray_cluster_yaml_is_valid_for_ray_up_with_the_local_provider() -> None:
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    jsonschema.validate(config, ray_schema())
    assert config["provider"]["type"] == "local"
    assert config["provider"]["head_ip"] == "HEAD_IP"
    assert config["provider"]["worker_ips"] == ["WORKER_IP_1", "WORKER_IP_2"]
    assert config["auth"]["ssh_user"]
    prepared = prepare_config(config)  # what `ray up` does before it touches any machine
    validate_config(prepared)
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == 2


@pytest.mark.unit
def test_ray_cluster_yaml_installs_tierflow_and_agrees_on_token_auth() -> None:
    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    assert config["file_mounts"]["~/tierflow"] == "."
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    setup = "\n".join(config["setup_commands"])
    assert "pip install -q -e ~/tierflow" in setup
    assert "openjdk-17-jdk-headless" in setup  # javac, for the JVM jetstream source
    assert setup.index("tierflow check") > setup.index("pip install -q -e ~/tierflow")
    assert "export RAY_AUTH_MODE=token" in setup  # for `ray submit` scripts and ray.init
    head, worker = config["head_start_ray_commands"], config["worker_start_ray_commands"]
    assert head[0] == worker[0] == "ray stop"
    start_head = next(c for c in head if "ray start --head" in c)
    assert "RAY_AUTH_MODE=token" in start_head
    for flag in ("--port=6379", "--dashboard-host=0.0.0.0", "--autoscaling-config="):
        assert flag in start_head
    start_worker = next(c for c in worker if "ray start --address" in c)
    assert "RAY_AUTH_MODE=token" in start_worker and "$RAY_HEAD_IP:6379" in start_worker
    assert any("deploy.master.Master 1 --host $HEAD --port 7077" in c for c in head)
    assert any("spark://$RAY_HEAD_IP:7077" in c for c in worker)


@pytest.mark.unit
def test_the_commented_aws_variant_is_valid_once_uncommented() -> None:
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    text = (CLUSTER / "ray-cluster.yaml").read_text()
    block = text[text.index("# provider:\n") :]
    aws = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    config = {k: v for k, v in yaml.safe_load(text).items() if k not in ("provider", "auth")}
    config.update(aws)
    jsonschema.validate(config, ray_schema())
    prepared = prepare_config(config)
    validate_config(prepared)
    assert prepared["provider"]["type"] == "aws"
    assert prepared["available_node_types"]["worker"]["min_workers"] == 2


# --------------------------------------------------------------------------- NATS cluster


def render_nats(template: str, **values: object) -> str:
    """envsubst's job: every ${VAR} must be given (substitute raises on a missing one)."""
    text = string.Template(template).substitute({k: str(v) for k, v in values.items()})
    assert "$" not in text
    return text


def http_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 (loopback)
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def stop_pids(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM the processes we started, SIGKILL any that linger, reap all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _spawn_trio(template: str, base: Path) -> tuple[list[subprocess.Popen[bytes]], list[int]]:
    """Three nats-servers from the template on 9 ports chosen now (client, monitor, route
    ports, 3 each), in `base`/n1..n3; returns the processes and the ports."""
    ports = free_ports(9)
    client, monitor, route = ports[0:3], ports[3:6], ports[6:9]
    routes = {f"NATS_ROUTE_{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(route)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(3):
            node = base / f"n{i + 1}"
            node.mkdir(parents=True)
            conf = node / "nats.conf"
            conf.write_text(
                render_nats(
                    template,
                    NATS_SERVER_NAME=f"tierflow-n{i + 1}",
                    NATS_HOST="127.0.0.1",
                    NATS_CLIENT_PORT=client[i],
                    NATS_MONITOR_PORT=monitor[i],
                    NATS_CLUSTER_PORT=route[i],
                    NATS_STORE_DIR=node / "store",
                    **routes,
                )
            )
            check = subprocess.run(
                [nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, timeout=30
            )
            assert check.returncode == 0, check.stderr.decode()
            with open(node / "nats.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [nats_server_binary(), "-c", str(conf)],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
    except BaseException:
        stop_pids(procs)
        raise
    return procs, ports


@pytest.fixture
def nats_trio(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Three nats-server processes, each from cluster/nats-cluster.conf rendered for it.

    Their ports are chosen free and bound a moment later: when another process took one
    in between (a node says so and exits), the three start again on new ports, as
    `NatsCluster` does, at most `PORT_ATTEMPTS` times."""
    template = (CLUSTER / "nats-cluster.conf").read_text()

    def meta_ready(procs: list[subprocess.Popen[bytes]], monitor: list[int]) -> bool:
        for p in procs:
            assert p.poll() is None, "a nats-server exited while starting"
        metas = [
            (http_json(f"http://127.0.0.1:{m}/jsz") or {}).get("meta_cluster") for m in monitor
        ]
        leaders = {m.get("leader") for m in metas if m and m.get("cluster_size") == 3}
        return len([m for m in metas if m]) == 3 and len(leaders) == 1 and None not in leaders

    for attempt in range(1, PORT_ATTEMPTS + 1):
        base = tmp_path / f"start-{attempt}"
        procs, ports = _spawn_trio(template, base)
        try:
            wait_until(
                lambda procs=procs, monitor=ports[3:6]: meta_ready(procs, monitor),
                45.0,
                0.1,
                "a JetStream meta leader agreed by all 3 nodes",
            )
            break
        except BaseException:
            stop_pids(procs)
            out = "".join(log.read_text("utf-8", "replace") for log in base.glob("n*/nats.log"))
            if not (taken_ports(out) and attempt < PORT_ATTEMPTS):
                raise
    try:
        yield {"procs": procs, "urls": [f"nats://127.0.0.1:{p}" for p in ports[0:3]]}
    finally:
        stop_pids(procs)


async def test_nats_template_forms_a_3_node_cluster_whose_r3_stream_takes_writes(
    nats_trio: dict[str, Any],
) -> None:
    import nats.errors
    from nats.js.api import StorageType, StreamConfig

    procs: list[subprocess.Popen[bytes]] = nats_trio["procs"]
    nc = await connect(nats_trio["urls"])
    try:
        js = nc.jetstream(timeout=5.0)
        cfg = StreamConfig(
            name="R3TEST", subjects=["r3.>"], num_replicas=3, storage=StorageType.FILE
        )
        await await_until(lambda: js.add_stream(cfg), 30.0, 0.2, "R3 stream", swallow=True)

        async def publish(ids: range, deadline_s: float) -> None:
            for i in ids:  # retried with the same id until acked: dedup keeps one copy
                await await_until(
                    lambda i=i: js.publish(f"r3.{i}", b"x", headers={"Nats-Msg-Id": str(i)}),
                    deadline_s,
                    0.1,
                    f"ack of {i}",
                    swallow=True,
                )

        await publish(range(200), 10.0)
        info = await js.stream_info("R3TEST")
        assert info.config.num_replicas == 3 and info.state.messages == 200
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2

        # stop the stream's leader (a process we started): the other two keep a quorum
        names = [f"tierflow-n{i + 1}" for i in range(3)]
        leader = procs[names.index(info.cluster.leader)]
        leader.send_signal(signal.SIGTERM)
        leader.wait(15)
        await publish(range(200, 250), 30.0)

        async def settled() -> Any:
            i = await js.stream_info("R3TEST")
            return i if i.cluster and i.cluster.leader != info.cluster.leader else None

        after = await await_until(settled, 30.0, 0.2, "a new stream leader", swallow=True)
        assert after.state.messages == 250
    finally:
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await asyncio.wait_for(nc.close(), 10)


# --------------------------------------------------------------------------- Spark


def spark_conf(path: Path) -> dict[str, str]:
    """spark-defaults.conf as Spark reads it: `key value` lines, # comments."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value.strip()
    return out


def parse_mem_mib(text: str) -> int:
    units = {"m": 1, "g": 1024}
    return int(text[:-1]) * units[text[-1].lower()]


@pytest.mark.unit
def test_spark_defaults_fit_two_core_workers() -> None:
    conf = spark_conf(CLUSTER / "spark-defaults.conf")
    assert all(k.startswith("spark.") for k in conf)
    assert conf["spark.master"] == "spark://HEAD_IP:7077"
    assert conf["spark.pyspark.python"].endswith("/tierflow-venv/bin/python")
    assert conf["spark.sql.streaming.checkpointLocation"].startswith("file:///mnt/shared/")
    assert conf["spark.sql.variable.substitute"] == "false"  # checked SQL is what runs
    # the YAML's workers offer 2 cores and 3g: whole executors must fit
    worker = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    start = next(c for c in worker["worker_start_ray_commands"] if "deploy.worker.Worker" in c)
    assert "--cores 2 --memory 3g" in start
    cores = int(conf["spark.executor.cores"])
    per_worker = 2 // cores
    assert per_worker >= 1
    assert per_worker * parse_mem_mib(conf["spark.executor.memory"]) <= 3 * 1024


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_spark_defaults_drive_a_real_standalone_master_and_worker(tmp_path: Path) -> None:
    """Start the master and a worker the way the YAML does (spark-daemon.sh from the pyspark
    wheel), on loopback; a session that names no master finds it in spark-defaults.conf.

    Spark binds the next port up when the one it was given is taken (`spark.port.maxRetries`):
    the worker and the session are given the ports the master's log says it bound."""
    import pyspark

    spark_home = Path(pyspark.__file__).parent
    master_port, master_ui, worker_ui = free_ports(3)
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()

    def write_conf(master_port: int) -> None:
        text = (CLUSTER / "spark-defaults.conf").read_text()
        text = text.replace("spark://HEAD_IP:7077", f"spark://127.0.0.1:{master_port}")
        text = text.replace("/home/ubuntu/tierflow-venv/bin/python", sys.executable)
        text = text.replace("file:///mnt/shared/tierflow/spark-checkpoints", tmp_path.as_uri())
        # test-only: the driver on loopback, and one executor core (the suite fits on 2 cores)
        text += "\nspark.driver.host 127.0.0.1\nspark.driver.bindAddress 127.0.0.1\n"
        text += "spark.cores.max 1\n"
        (conf_dir / "spark-defaults.conf").write_text(text)

    write_conf(master_port)
    env = {
        **os.environ,
        "SPARK_HOME": str(spark_home),
        "SPARK_CONF_DIR": str(conf_dir),
        "SPARK_LOG_DIR": str(tmp_path / "logs"),
        "SPARK_PID_DIR": str(tmp_path / "pids"),
        "SPARK_LOCAL_IP": "127.0.0.1",  # web UIs too bind loopback
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    daemon = str(spark_home / "sbin" / "spark-daemon.sh")
    master = "org.apache.spark.deploy.master.Master"
    worker = "org.apache.spark.deploy.worker.Worker"

    def sh(*args: str) -> None:
        subprocess.run([daemon, *args], env=env, check=True, timeout=60, capture_output=True)

    def master_bound(pattern: str, what: str) -> int:
        """The port the master's log says it bound (`pattern`'s group)."""
        found: list[int] = []

        def logged() -> bool:
            for log in (tmp_path / "logs").glob("*Master*.out"):
                if m := re.search(pattern, log.read_text("utf-8", "replace")):
                    found.append(int(m[1]))
                    return True
            return False

        wait_until(logged, 60.0, 0.2, what)
        return found[0]

    try:
        sh(
            "start",
            master,
            "1",
            "--host",
            "127.0.0.1",
            "--port",
            str(master_port),
            "--webui-port",
            str(master_ui),
        )
        master_port = master_bound(
            r"Starting Spark master at spark://127\.0\.0\.1:(\d+)", "the master's port"
        )
        master_ui = master_bound(r"Bound MasterWebUI to \S+ and started at \S+:(\d+)", "its UI")
        write_conf(master_port)  # the session finds the master where it is
        sh(
            "start",
            worker,
            "1",
            "--host",
            "127.0.0.1",
            "--cores",
            "2",
            "--memory",
            "3g",
            "--work-dir",
            str(tmp_path / "work"),
            "--webui-port",
            str(worker_ui),
            f"spark://127.0.0.1:{master_port}",
        )

        def worker_alive() -> bool:
            state = http_json(f"http://127.0.0.1:{master_ui}/json/") or {}
            return any(w.get("state") == "ALIVE" for w in state.get("workers", []))

        wait_until(worker_alive, 60.0, 0.2, "the Spark worker registered with the master")
        job = (
            "from pyspark.sql import SparkSession\n"
            "import json, sys\n"
            "s = SparkSession.builder.appName('tierflow-cluster-test').getOrCreate()\n"
            "sc = s.sparkContext\n"
            "py = sc.parallelize([0], 1).map(lambda _: __import__('sys').executable).collect()\n"
            "print(json.dumps({'master': sc.master, 'sum': sc.parallelize(range(1000), 4).sum(),"
            " 'cores': sc.getConf().get('spark.executor.cores'), 'python': py[0]}))\n"
            "s.stop()\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", job], env=env, capture_output=True, timeout=150, text=True
        )
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        assert out["master"] == f"spark://127.0.0.1:{master_port}"
        assert out["sum"] == 499500 and out["cores"] == "1"
        assert Path(out["python"]).parent == Path(sys.executable).parent  # the venv's python
    finally:
        for cls in (worker, master):
            subprocess.run([daemon, "stop", cls, "1"], env=env, timeout=60, capture_output=True)
        for pid_file in (tmp_path / "pids").glob("*.pid"):  # stop failed: kill what is ours
            with contextlib.suppress(OSError, ValueError):
                pid = int(pid_file.read_text().strip())
                if str(conf_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
