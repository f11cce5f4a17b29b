"""Where the Spark driver JVM's class-data-sharing archive lives, and the flag that maps it.

A fresh Spark JVM spends most of its first ten seconds loading and verifying the same
~20,000 classes from Spark's jars. JDK 13+ can dump the classes a run loaded into an
archive (``-XX:ArchiveClassesAtExit``) that later JVMs map instead
(``-XX:SharedArchiveFile``; JEP 350, "dynamic CDS"). Measured on this project's 2-core
machine (docs/benchmarks.md): a SparkSession in 7.2 s instead of 11.7, a streaming
query's first batch 11.8 s after the start instead of 18.7. That is every analysis-driver
restart, every `tierflow sql` and history command, and every Spark test.

The archive is only valid for the JVM and class path it was made with, so its file name
carries a digest of both (the java binary and version, pyspark's version, and the paths,
sizes and modification times of its jars, which the JVM checks too): another JDK, pyspark
or venv, or a venv reinstalled at the same path, finds no archive of its own and starts as
before. A JVM handed an archive that does not match runs without it (``-Xshare:auto``, the
default) after one warning line; that line goes to stderr (`STDOUT_CLEAN`), since the
driver JVM shares stdout with commands such as ``tierflow sql --json`` whose output is
data. `jobs.class_training`
builds it (`tierflow check` runs that once per venv); this module only names and uses it,
and imports nothing above the foundation.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

CACHE_ENV = "TIERFLOW_CACHE_DIR"
DRIVER_OPTIONS = "spark.driver.extraJavaOptions"


def cache_dir(environ: dict[str, str] | None = None) -> Path:
    """``$TIERFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/tierflow``, else ``~/.cache/tierflow``:
    per user and machine, not per state dir, so every run and test on the machine shares
    one archive."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierflow"


def spark_java() -> str | None:
    """The java that spark-submit runs: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "java").exists():
        return str(Path(home, "bin", "java").resolve())
    found = shutil.which("java")
    return str(Path(found).resolve()) if found else None


@functools.cache
def java_version_text(java: str) -> str:
    """`java -version`'s banner ("" when it cannot run); once per binary and process, as
    `require_java` and the archive's key both read it on every SparkSession's start."""
    try:
        return subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        ).stderr
    except (OSError, subprocess.TimeoutExpired):
        return ""


def jvm_build(version_text: str) -> str:
    """The JVM's identity in `java -version`'s banner, without what describes this run: the
    launcher's "Picked up JAVA_TOOL_OPTIONS: ..." notes and the VM line's modes ("mixed mode,
    sharing", or "emulated-client" for C1 only, as make test runs every JVM). The same JVM
    maps the same archive under any of those."""
    lines = (line for line in version_text.splitlines() if not _PICKED_UP.match(line))
    return "\n".join(_RUN_MODES.sub(r"\1)", line) for line in lines)


# what the launcher prints for JAVA_TOOL_OPTIONS, _JAVA_OPTIONS and JDK_JAVA_OPTIONS
_PICKED_UP = re.compile(r"(NOTE: )?Picked up \w+: ")
# "(build 17.0.15+6-Debian-1deb12u1, mixed mode, sharing)": the build, then the modes
_RUN_MODES = re.compile(r"(\(build [^,)]+)[^)]*\)")


def spark_jars() -> list[str]:
    """pyspark's jars, sorted, by absolute path: the class path spark-submit gives the
    driver (the archive records paths, so another venv's copy of the same jars is another
    class path)."""
    import pyspark

    jars = Path(pyspark.__file__).resolve().parent / "jars"
    return sorted(str(p) for p in jars.glob("*.jar")) if jars.is_dir() else []


def stamp(path: str) -> str:
    """A class path entry as the JVM validates it: a jar by path, size and modification
    time (a reinstall at the same path makes another jar); a directory by path."""
    if not path.endswith(".jar"):
        return path
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{path}|{st.st_size}|{st.st_mtime_ns}"


def archive_key(java: str, version_text: str, pyspark_version: str, jars: list[str]) -> str:
    """A digest of what makes an archive valid: the JVM and the class path (each entry
    `stamp`ed by the caller)."""
    h = hashlib.sha256()
    for part in (java, jvm_build(version_text), pyspark_version, *jars):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def archive_path(directory: Path | None = None) -> Path | None:
    """This machine's archive path for the installed java and pyspark (whether or not it
    has been built); None without java."""
    java = spark_java()
    if java is None:
        return None
    import pyspark

    # SPARK_CONF_DIR heads the driver's class path when it is set (a cluster's conf dir)
    conf = os.environ.get("SPARK_CONF_DIR", "")
    classpath = [conf, *spark_jars()] if conf else spark_jars()
    stamped = [stamp(p) for p in classpath]
    key = archive_key(java, java_version_text(java), pyspark.__version__, stamped)
    return (directory or cache_dir()) / f"spark-driver-{key}.jsa"


def with_java_option(conf: dict[str, str], option: str) -> dict[str, str]:
    """`conf` with `option` (one or more words) appended to the driver's JVM options (the
    user's come first); unchanged when they hold it already."""
    mine = conf.get(DRIVER_OPTIONS, "").strip()
    words = mine.split()
    if all(word in words for word in option.split()):
        return dict(conf)
    return {**conf, DRIVER_OPTIONS: f"{mine} {option}".strip()}


def use_option(path: Path) -> str:
    return f"-XX:SharedArchiveFile={path}"


# The archive's warnings to stderr: unified logging prints warnings on stdout by default,
# and an archive the JVM cannot map must not write into a command's data there. Only the
# cds tags' stdout output changes; the user's other -Xlog outputs stay as they were.
STDOUT_CLEAN = "-Xlog:cds*=off:stdout -Xlog:cds*=warning:stderr"


def dump_options(path: Path) -> str:
    """Dump the loaded classes at exit; the JVM's per-class "skipping" lines are silenced
    (signed jars and generated classes cannot be archived; the JVM loads them the usual way)."""
    return f"-XX:ArchiveClassesAtExit={path} -Xlog:cds=off -Xlog:cds+dynamic=off"
