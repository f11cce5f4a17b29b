"""Ad-hoc SQL cannot read the driver's secrets nor blow the driver up: Spark's `${...}`
substitution is off in every session tierflow makes and `${` is refused in the checker;
size-amplifying calls, hints and joins without a condition are refused before Spark plans
them; the answer has a byte limit. Unit tests for runtime/data/sql_check.py and the admission
policy, and real Spark for the substitution and the SQL session's settings.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from jobs.sql import SqlResult, run_sql
from jobs.sql_admission import SqlAdmission
from runtime.data.sql_check import SqlRefused, check_select
from runtime.nats.server import NatsEndpoint

KNOWN = ["meetup", "results", "flights"]
SECRET_CONF = "spark.tierflow.test.secret"
SECRET = "s3cr3t-from-spark-conf"

# What substitution would read: the JVM's environment (it inherits PYSPARK_PYTHON from
# runtime.engines.services.spark_session), a Java system property and a Spark setting.
SUBSTITUTED = [
    "SELECT '${env:PYSPARK_PYTHON}' AS p",
    "SELECT '${system:java.home}' AS p",
    f"SELECT '${{{SECRET_CONF}}}' AS p",
]


# --------------------------------------------------------------------------- unit: the checker


@pytest.mark.unit
@pytest.mark.parametrize(
    "sql",
    [
        *SUBSTITUTED,
        "SELECT 1 AS p -- ${env:HOME}",
        "SELECT /* ${system:user.name} */ 1",
        "SELECT * FROM meetup WHERE city = '${hiveconf:x}'",
        "SELECT '\\${env:HOME}' AS p",
    ],
)
def test_variable_references_are_refused_with_the_reason(sql: str) -> None:
    with pytest.raises(SqlRefused, match=r"\$\{.*substitut"):
        check_select(sql, KNOWN)


@pytest.mark.unit
def test_an_escape_that_renders_as_a_variable_is_refused_too() -> None:
    # the checked tree is rendered again for Spark: a `$` written as an escape must not
    # come out as `${` there
    for sql in ("SELECT '\\u0024{env:HOME}' AS p", "SELECT '$' || '{env:HOME}' AS p"):
        try:
            checked = check_select(sql, KNOWN)
        except SqlRefused as err:
            assert "${" in str(err) or "substitut" in str(err)
            continue
        assert "${" not in checked.sql


@pytest.mark.unit
@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("SELECT repeat('x', 100000000) FROM meetup", "repeat"),
        (
            "SELECT repeat('x', 100000000) AS s FROM (SELECT explode(sequence(1, 1000)) AS i)",
            "repeat",
        ),
        ("SELECT size(sequence(1, 1000000000)) AS n", "sequence"),
        ("SELECT explode(sequence(1, n)) FROM meetup", "sequence"),
        ("SELECT space(n) FROM meetup", "space"),
        ("SELECT lpad(city, 50000000, 'x') FROM meetup", "lpad"),
        ("SELECT rpad(city, 50000000, 'x') FROM meetup", "rpad"),
        ("SELECT array_repeat(city, 100000000) FROM meetup", "array_repeat"),
        ("SELECT randstr(100000000) AS s", "randstr"),
        ("SELECT format_string('%100000000d', 1) AS s", "format_string"),
        (
            "SELECT explode(sequence(1, 5000)) AS a, explode(sequence(1, 5000)) AS b",
            "multiply",
        ),
        ("SELECT /*+ BROADCAST(m) */ * FROM meetup m JOIN results r ON m.id = r.id", "hint"),
        ("SELECT /*+ REPARTITION(100000) */ * FROM meetup", "hint"),
        ("SELECT * FROM meetup CROSS JOIN results", "condition"),
        ("SELECT * FROM meetup a, meetup b", "condition"),
        ("SELECT * FROM meetup a JOIN meetup b", "condition"),
        ("SELECT * FROM meetup a NATURAL JOIN results b", "condition"),
        (
            "WITH a AS (SELECT * FROM meetup), b AS (SELECT x.* FROM a x CROSS JOIN a y), "
            "c AS (SELECT x.* FROM b x CROSS JOIN b y) SELECT count(*) FROM c",
            "condition",
        ),
        (
            "SELECT count(*) FROM meetup a JOIN meetup b ON a.id = b.id JOIN meetup c "
            "ON b.id = c.id JOIN meetup d ON c.id = d.id JOIN meetup e ON d.id = e.id "
            "JOIN meetup f ON e.id = f.id",
            "joins",
        ),
    ],
)
def test_size_amplifiers_hints_and_unconditioned_joins_are_refused(sql: str, reason: str) -> None:
    with pytest.raises(SqlRefused, match=reason):
        check_select(sql, KNOWN)


@pytest.mark.unit
@pytest.mark.parametrize(
    "sql",
    [
        "SELECT repeat('-', 40) AS line, lpad(city, 12, ' ') AS c FROM meetup",
        "SELECT explode(sequence(1, 24)) AS hour",
        "SELECT * FROM meetup a, results b WHERE a.id = b.id",
        "SELECT * FROM meetup a JOIN results b USING (id)",
        "SELECT format_string('%05d', 7) AS s",
    ],
)
def test_bounded_uses_of_the_same_features_pass(sql: str) -> None:
    check_select(sql, KNOWN)


@pytest.mark.unit
def test_an_unknown_table_lists_only_the_tables_the_caller_may_read() -> None:
    with pytest.raises(SqlRefused, match="unknown table 'nope'") as err:
        check_select("SELECT * FROM nope", KNOWN, listed=["results"])
    assert "the tables are: results" in str(err.value)
    assert "meetup" not in str(err.value) and "flights" not in str(err.value)


@pytest.mark.unit
def test_admission_answers_full_with_a_retry_after_from_the_running_deadlines() -> None:
    now = [100.0]
    gate = SqlAdmission(2, clock=lambda: now[0])
    a = gate.enter(30.0)
    b = gate.enter(5.0)
    assert a is not None and b is not None
    assert gate.enter(1.0) is None
    assert gate.retry_after_s() == 5  # the sooner of the two deadlines
    now[0] = 104.2
    assert gate.retry_after_s() == 1
    gate.leave(b)
    c = gate.enter(1.0)
    assert c is not None and gate.enter(1.0) is None
    gate.leave(a)
    gate.leave(c)
    assert gate.running() == 0


@pytest.mark.unit
@pytest.mark.parametrize("state", ["ALIVE", "RESTARTING"])
def test_a_standby_hands_sql_to_the_active_drivers_sql_threads(
    state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby hands a query to its peer's `sql` (its SQL threads, never the control
    methods' as `from_standby` would), marked forwarded so it is never handed on again; a
    peer Ray is restarting gets no call (it would wait for the restart)."""
    from types import SimpleNamespace

    from jobs import warm_pair
    from jobs.driver import SQL_GROUP, AnalysisDriver, AnalysisDriverError
    from tests.test_standby import a_standby_pair

    sent: list[tuple[Any, ...]] = []
    peer = SimpleNamespace(
        sql=SimpleNamespace(remote=lambda *a, **kw: sent.append((*a, kw)) or "ref")
    )
    standby = AnalysisDriver.__new__(AnalysisDriver)
    standby.name = "tierflow-analysis-standby"
    standby._pair = a_standby_pair(standby.name, "tierflow-analysis", AnalysisDriverError)
    assert standby.role == "standby"
    monkeypatch.setattr(standby._pair, "peer_handle", lambda: peer)
    monkeypatch.setattr(warm_pair, "actor_state", lambda handle: state)
    monkeypatch.setattr(warm_pair.ray, "get", lambda ref, timeout: {"status": 200})
    answer = standby.sql("SELECT 1", 10, 5.0, ["orders"])
    if state == "ALIVE":
        assert answer == {"status": 200}
        assert sent == [("SELECT 1", 10, 5.0, ["orders"], {"forwarded": True})]
    else:
        assert answer["status"] == 503 and "restarting" in answer["error"].lower()
        assert sent == []
    # handed on once only: a standby answering a forwarded call does not forward it again
    assert standby.sql("SELECT 1", forwarded=True)["status"] == 503
    assert AnalysisDriver.sql.__ray_concurrency_group__ == SQL_GROUP
    assert AnalysisDriver.sql.__ray_max_task_retries__ == 0


# --------------------------------------------------------------------------- real Spark


@pytest.fixture(scope="module")
def secret_spark(spark: Any) -> Any:
    spark.conf.set(SECRET_CONF, SECRET)
    yield spark
    spark.conf.unset(SECRET_CONF)


def _leaked(value: str) -> list[str]:
    """Which of the values substitution would read are in `value`."""
    known = [os.environ.get("PYSPARK_PYTHON", sys.executable), SECRET]
    return [k for k in known if k and k in value]


@pytest.mark.parametrize("sql", SUBSTITUTED)
def test_a_session_used_directly_does_not_substitute(secret_spark: Any, sql: str) -> None:
    (row,) = secret_spark.sql(sql).collect()
    assert row.p.startswith("${") and not _leaked(row.p), row.p
    if "java.home" in sql:
        assert "/" not in row.p


@pytest.mark.parametrize("sql", SUBSTITUTED)
def test_run_sql_refuses_variable_references(secret_spark: Any, sql: str) -> None:
    result: SqlResult | None = None
    with pytest.raises(SqlRefused, match=r"\$\{"):
        result = run_sql(secret_spark, NatsEndpoint("nats://127.0.0.1:1"), sql, {})
    assert result is None


def test_the_sql_session_keeps_its_settings_to_itself(spark: Any) -> None:
    from jobs.spark_session import SQL_SESSION_CONF, sql_session

    own = sql_session(spark)
    for key, value in SQL_SESSION_CONF.items():
        assert own.conf.get(key) == value, key
    assert own.sparkContext is spark.sparkContext
    # the streaming queries' session keeps broadcast joins and hints
    assert spark.conf.get("spark.sql.autoBroadcastJoinThreshold") != "-1"
    assert spark.conf.get("spark.sql.variable.substitute") == "false"
    # Spark itself refuses an implicit cartesian product in the SQL session
    own.range(3).createOrReplaceTempView("a3")
    with pytest.raises(Exception, match="(?i)cartesian"):
        own.sql("SELECT count(*) FROM a3 x, a3 y WHERE x.id < 2").collect()
    own.catalog.dropTempView("a3")


def test_the_answer_has_a_byte_limit_and_the_pool_is_the_callers(spark: Any) -> None:
    from jobs.spark_session import POOL_PROPERTY, SQL_POOL

    nats = NatsEndpoint("nats://127.0.0.1:1")  # table-less: nothing is read
    every = run_sql(spark, nats, "SELECT explode(sequence(1, 100)) AS i", {})
    assert len(every.rows) == 100 and not every.truncated
    # each row is `[i]` and a separator: 4 bytes up to 9, 5 from 10
    cut = run_sql(spark, nats, "SELECT explode(sequence(1, 100)) AS i", {}, max_bytes=50)
    assert cut.rows == [(i,) for i in range(1, 12)] and cut.truncated
    with pytest.raises(SqlRefused, match="one row of the answer is over 1000 bytes"):
        run_sql(spark, nats, "SELECT repeat('x', 5000) AS s", {}, max_bytes=1000)
    run_sql(spark, nats, "SELECT 1 AS one", {}, pool=SQL_POOL)
    assert spark.sparkContext.getLocalProperty(POOL_PROPERTY) is None


def test_a_query_without_a_table_runs_only_for_a_caller_allowed_on_every_table(
    spark: Any,
) -> None:
    from jobs.sql import StreamTable

    nats = NatsEndpoint("nats://127.0.0.1:1")
    tables = {"orders": StreamTable("orders"), "hidden": StreamTable("hidden")}
    with pytest.raises(SqlRefused, match="names no table"):
        run_sql(spark, nats, "SELECT 1 AS one", tables, allowed=lambda s: s == "orders")
    with pytest.raises(SqlRefused, match="the tables are: orders$"):
        run_sql(spark, nats, "SELECT * FROM nope", tables, allowed=lambda s: s == "orders")
    assert run_sql(spark, nats, "SELECT 1 AS one", tables).rows == [(1,)]
