"""Spark's class archive (runtime/engines/class_archive.py, jobs/class_training.py): named by what
makes it valid, appended to the user's JVM options, only ever put in place whole, and
really mapped by a fresh Spark driver JVM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from jobs import class_training
from runtime.config import load
from runtime.engines import class_archive
from runtime.engines.class_archive import (
    DRIVER_OPTIONS,
    STDOUT_CLEAN,
    archive_key,
    cache_dir,
    jvm_build,
    use_option,
    with_java_option,
)
from runtime.engines.services import driver_class_archive

JAVA = "/usr/lib/jvm/java-17/bin/java"


@pytest.mark.unit
def test_the_cache_dir_follows_the_environment() -> None:
    assert cache_dir({"TIERFLOW_CACHE_DIR": "/x/y", "XDG_CACHE_HOME": "/c"}) == Path("/x/y")
    assert cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/tierflow")
    assert cache_dir({}) == Path.home() / ".cache" / "tierflow"


@pytest.mark.unit
def test_the_key_changes_with_the_jvm_and_the_class_path() -> None:
    base = archive_key(JAVA, 'version "17.0.15"', "4.3.0", ["a.jar", "b.jar"])
    assert base == archive_key(JAVA, 'version "17.0.15"', "4.3.0", ["a.jar", "b.jar"])
    others = {
        archive_key("/opt/jdk21/bin/java", 'version "17.0.15"', "4.3.0", ["a.jar", "b.jar"]),
        archive_key(JAVA, 'version "17.0.16"', "4.3.0", ["a.jar", "b.jar"]),
        archive_key(JAVA, 'version "17.0.15"', "4.3.1", ["a.jar", "b.jar"]),
        archive_key(JAVA, 'version "17.0.15"', "4.3.0", ["a.jar", "c.jar"]),
        archive_key(JAVA, 'version "17.0.15"', "4.3.0", ["a.jarb.jar"]),  # no run-together
        archive_key(JAVA, 'version "17.0.15"', "4.3.0", ["/other-venv/a.jar", "b.jar"]),
    }
    assert base not in others and len(others) == 6


@pytest.mark.unit
def test_the_option_goes_after_the_users_own_and_only_once() -> None:
    opt = use_option(Path("/c/a.jsa"))
    assert with_java_option({}, opt) == {DRIVER_OPTIONS: opt}
    mine = {DRIVER_OPTIONS: "-Dfoo=1 -Xss4m", "other": "x"}
    added = with_java_option(mine, opt)
    assert added == {DRIVER_OPTIONS: f"-Dfoo=1 -Xss4m {opt}", "other": "x"}
    assert with_java_option(added, opt) == added
    assert mine == {DRIVER_OPTIONS: "-Dfoo=1 -Xss4m", "other": "x"}  # not changed in place


@pytest.mark.unit
def test_the_session_conf_maps_an_archive_only_when_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "spark-driver-k.jsa"
    monkeypatch.setattr("runtime.engines.services.archive_path", lambda: archive)
    cfg = load(environ={})
    assert driver_class_archive(cfg, {"a": "b"}) == {"a": "b"}  # none built yet
    archive.write_bytes(b"x")
    mapped = f"{use_option(archive)} {STDOUT_CLEAN}"
    assert driver_class_archive(cfg, {"a": "b"}) == {"a": "b", DRIVER_OPTIONS: mapped}
    off = msgspec.structs.replace(
        cfg, spark=msgspec.structs.replace(cfg.spark, class_archive=False)
    )
    assert driver_class_archive(off, {}) == {}
    # the user's own archive, or a dump of one, wins
    for own in ("-XX:SharedArchiveFile=/mine.jsa", "-XX:ArchiveClassesAtExit=/new.jsa"):
        assert driver_class_archive(cfg, {DRIVER_OPTIONS: own}) == {DRIVER_OPTIONS: own}


def test_java_options_from_the_environment_leave_the_key_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's "Picked up JAVA_TOOL_OPTIONS" note and the VM's run modes are not the
    JVM: with C1 only (make test's JVMs) the same JVM keeps its archive."""
    java = class_archive.spark_java()
    assert java is not None
    read = class_archive.java_version_text.__wrapped__
    monkeypatch.delenv("JAVA_TOOL_OPTIONS", raising=False)
    plain = read(java)
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1")
    c1 = read(java)
    assert "Picked up JAVA_TOOL_OPTIONS" in c1 and c1 != plain  # what the launcher prints
    assert jvm_build(c1) == jvm_build(plain)
    assert "(build " in jvm_build(plain) and "mode" not in jvm_build(plain)
    key = archive_key(java, c1, "4.3.0", ["/a.jar"])
    assert key == archive_key(java, plain, "4.3.0", ["/a.jar"])
    other = plain.replace("(build ", "(build 9", 1)
    assert archive_key(java, other, "4.3.0", ["/a.jar"]) != key


def test_a_partial_or_foreign_archive_is_refused(tmp_path: Path) -> None:
    java = class_archive.spark_java()
    assert java is not None
    junk = tmp_path / "junk.jsa"
    junk.write_bytes(b"\0" * 4096)
    assert not class_training.maps(java, junk, str(tmp_path))


def test_a_present_archive_is_not_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = class_archive.archive_path(tmp_path)
    assert path is not None and path.parent == tmp_path
    path.write_bytes(b"built before")

    def no_training(*args: object, **kw: object) -> None:
        raise AssertionError("trained again")

    monkeypatch.setattr(class_training, "subprocess", SimpleNamespace(run=no_training))
    built = class_training.build(tmp_path)
    assert (built.path, built.fresh) == (path, False)
    assert path.read_bytes() == b"built before"


@pytest.mark.timeout(600)
def test_a_fresh_spark_driver_loads_sparks_classes_from_the_archive(tmp_path: Path) -> None:
    """The machine's archive (built here when `tierflow check` has not) is what a new
    session's JVM loads SparkContext from, per the JVM's own class-load log."""
    built = class_training.build()
    log = tmp_path / "classload.log"
    script = textwrap.dedent(
        f"""
        from runtime.config import load
        from runtime.engines.services import spark_session
        cfg = load(environ={{}}, overrides={{
            "state_dir": {str(tmp_path / "state")!r},
            "spark": {{"master": "local[1]", "conf": {{
                "spark.driver.extraJavaOptions": "-Xlog:class+load=info:file={log}"}}}},
        }})
        spark_session(cfg).stop()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300, capture_output=True)
    lines = log.read_text().splitlines()
    context = [line for line in lines if " org.apache.spark.SparkContext " in line]
    assert context and "source: shared objects file (top)" in context[0], (built, context)
    shared = sum("shared objects file (top)" in line for line in lines)
    assert shared > 5_000, f"only {shared} of {len(lines)} classes from {built.path}"


@pytest.mark.unit
def test_archives_of_venvs_that_are_gone_are_pruned(tmp_path: Path) -> None:
    jar = tmp_path / "venv" / "jars" / "spark-core.jar"
    jar.parent.mkdir(parents=True)
    jar.write_bytes(b"")
    live, dead, unknown = (tmp_path / f"spark-driver-{k}.jsa" for k in ("live", "dead", "old"))
    for archive in (live, dead, unknown):
        archive.write_bytes(b"archive")
        archive.with_suffix(".lock").write_bytes(b"")
    Path(f"{live}.classpath").write_text(f"{tmp_path}/venv/conf:{jar}")
    Path(f"{dead}.classpath").write_text(f"{tmp_path}/gone/conf:{tmp_path}/gone/jars/a.jar")
    assert class_training.prune(tmp_path) == [dead]
    assert live.exists() and unknown.exists() and Path(f"{live}.classpath").exists()
    assert not dead.exists() and not Path(f"{dead}.classpath").exists()
    assert not dead.with_suffix(".lock").exists()
    assert not class_training.is_stale("/x/conf")  # no jars named: not judged


def test_a_spark_conf_dir_is_another_class_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spark-submit puts `SPARK_CONF_DIR` first on the driver's class path (a cluster's
    conf dir): an archive made without it would not map, so it names another archive."""
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    plain = class_archive.archive_path(tmp_path)
    monkeypatch.setenv("SPARK_CONF_DIR", "/cluster/conf")
    assert class_archive.archive_path(tmp_path) not in (plain, None)


@pytest.mark.unit
def test_a_venv_reinstalled_at_the_same_path_names_another_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JVM checks each jar's size and modification time, not only its path: a venv
    reinstalled where the old one was must not be handed the old venv's archive."""
    jars = [tmp_path / "jars" / name for name in ("a.jar", "b.jar")]
    jars[0].parent.mkdir()
    for jar in jars:
        jar.write_bytes(b"jar")
    monkeypatch.setattr(class_archive, "spark_jars", lambda: [str(j) for j in jars])
    # a unit test starts no JVM: the java binary and its banner as a machine would give them
    monkeypatch.setattr(class_archive, "spark_java", lambda: "/usr/bin/java")
    monkeypatch.setattr(class_archive, "java_version_text", lambda java: 'openjdk "17.0.15"')
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    before = class_archive.archive_path(tmp_path)
    assert class_archive.archive_path(tmp_path) == before
    stat = jars[1].stat()
    os.utime(jars[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert class_archive.archive_path(tmp_path) not in (before, None)


@pytest.mark.unit
def test_an_archive_older_than_its_jars_is_pruned(tmp_path: Path) -> None:
    jar = tmp_path / "venv" / "jars" / "spark-core.jar"
    jar.parent.mkdir(parents=True)
    jar.write_bytes(b"")
    archive = tmp_path / "spark-driver-old.jsa"
    archive.write_bytes(b"archive")
    Path(f"{archive}.classpath").write_text(str(jar))
    assert class_training.prune(tmp_path) == []  # built after its jars: kept
    built = archive.stat().st_mtime_ns
    os.utime(jar, ns=(built + 1_000_000_000, built + 1_000_000_000))  # reinstalled since
    assert class_training.prune(tmp_path) == [archive]
    assert not archive.exists() and not Path(f"{archive}.classpath").exists()


@pytest.mark.timeout(300)
def test_an_archive_the_jvm_refuses_keeps_stdout_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver JVM that cannot map the archive at its path (made for another class path
    here) says so on stderr: stdout carries only what the command prints (tierflow sql
    --json's rows), and the session starts as it would without an archive."""
    java = class_archive.spark_java()
    assert java is not None
    javac = Path(java).with_name("javac")
    src = tmp_path / "Hello.java"
    src.write_text("public class Hello { public static void main(String[] a) { } }")
    subprocess.run([str(javac), "-d", str(tmp_path), str(src)], check=True, timeout=120)
    jar = tmp_path / "hello.jar"
    with zipfile.ZipFile(jar, "w") as z:
        z.write(tmp_path / "Hello.class", "Hello.class")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIERFLOW_CACHE_DIR", str(cache))
    target = class_archive.archive_path()
    assert target is not None and target.parent == cache
    cache.mkdir()
    dump = class_archive.dump_options(target).split()
    subprocess.run([java, *dump, "-cp", str(jar), "Hello"], check=True, timeout=120)
    assert target.is_file()
    script = textwrap.dedent(
        f"""
        from runtime.config import load
        from runtime.engines.services import spark_session
        cfg = load(environ={{}}, overrides={{
            "state_dir": {str(tmp_path / "state")!r}, "spark": {{"master": "local[1]"}}}})
        spark = spark_session(cfg)
        print(spark.range(3).count(), flush=True)
        spark.stop()
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], timeout=240, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines() == ["3"], run.stdout[:2000]
    assert "Unable to use shared archive" in run.stderr
