"""Config loading: defaults, file, environment overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.config import ConfigError, dumps_toml, env_overrides, load, validate

pytestmark = pytest.mark.unit

EMPTY: dict[str, str] = {}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tierflow.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_embedded_setup() -> None:
    cfg = load(environ=EMPTY)
    assert cfg.nats.url == ""  # embedded server
    assert cfg.nats.sync_interval == "always"  # durable by default
    assert cfg.ray.address == "" and cfg.ray.namespace == "tierflow"
    assert cfg.spark.master == "local[*]"
    assert cfg.logging.mode == "hml"
    assert cfg.roles.logger.k == 1
    assert cfg.roles.collector.port == 8000 and cfg.roles.gateway.port == 8080
    assert set(cfg.streams) == {"results", "deadletter"}  # a demo brings its own (cluster/demo)


def test_file_then_env_then_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        state_dir = "/tmp/tf-state"
        [roles.logger]
        k = 2
        replicas = 2
        [streams.clicks]
        max_age_s = 3600
        """,
    )
    env = {"TIERFLOW_ROLES__LOGGER__K": "3", "TIERFLOW_NATS__URL": "nats://10.0.0.1:4222"}
    cfg = load(path, environ=env, overrides={"roles": {"collector": {"replicas": 4}}})
    assert cfg.state_dir == "/tmp/tf-state"
    assert cfg.roles.logger.k == 3  # env beats file
    assert cfg.roles.logger.replicas == 2  # file kept where env is silent
    assert cfg.roles.collector.replicas == 4
    assert cfg.nats.url == "nats://10.0.0.1:4222"
    # A file that names streams replaces the defaults (the system streams stay);
    # subjects default to raw.<name>.
    assert list(cfg.streams) == ["clicks", "results", "deadletter"]
    assert cfg.streams["clicks"].subjects == ["raw.clicks"]
    assert cfg.streams["clicks"].max_age_s == 3600


def test_env_values_parse_as_toml_or_string() -> None:
    env = {
        "TIERFLOW_NATS__PORT": "4333",
        "TIERFLOW_AUTH__PRODUCER_TOKENS": '["a", "b"]',
        "TIERFLOW_NATS__USER": "alice",
        "TIERFLOW_NATS__PASSWORD": "s3cret",
        "OTHER": "ignored",
    }
    over = env_overrides(env)
    assert over == {
        "nats": {"port": 4333, "user": "alice", "password": "s3cret"},
        "auth": {"producer_tokens": ["a", "b"]},
    }


def test_config_file_via_env_var(tmp_path: Path) -> None:
    path = write(tmp_path, "[roles.gateway]\nport = 9090\n")
    assert load(environ={"TIERFLOW_CONFIG": str(path)}).roles.gateway.port == 9090


def test_the_cache_dir_variable_is_not_a_config_key(tmp_path: Path) -> None:
    """`TIERFLOW_CACHE_DIR` (where Spark's class archive lives) shares the prefix of the
    config's overrides; every CLI command loads the config with it set."""
    path = write(tmp_path, "[roles.gateway]\nport = 9090\n")
    environ = {"TIERFLOW_CACHE_DIR": str(tmp_path), "TIERFLOW_CONFIG": str(path)}
    assert load(environ=environ).roles.gateway.port == 9090
    assert env_overrides(environ) == {}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"roles": {"logger": {"k": -1}}}, "roles.logger.k: Expected `int` >= 0"),
        ({"roles": {"logger": {"k": "two"}}}, "roles.logger.k: Expected `int`, got `str`"),
        (
            {"roles": {"collector": {"port": 70000}}},
            "roles.collector.port: Expected `int` <= 65535",
        ),
        ({"roles": {"router": {"k": 1}}}, "roles: Object contains unknown field `router`"),
        ({"nats": {"sync_interval": "sometimes"}}, "nats.sync_interval: Expected `str` matching"),
        ({"logging": {"mode": "wal"}}, "logging.mode: Invalid enum value 'wal'"),
        ({"streams": {"bad name": {}}}, "streams.bad name: stream names use letters"),
        ({"streams": {"s": {"max_age_s": -5}}}, "streams.s.max_age_s: Expected `float` >= 0"),
        ({"streams": {"s": {"subjects": "raw.s"}}}, "streams.s.subjects: Expected `array`"),
        ({"streams": ["s"]}, "streams: Expected `table`"),
        ({"spark": {"log_level": "LOUD"}}, "spark.log_level"),
        ({"nats": {"user": "u"}}, "nats.password: required when nats.user is set"),
        (
            {"roles": {"collector": {"port": 9000}, "gateway": {"port": 9000}}},
            "roles.gateway.port: port 9000 is already used by roles.collector.port",
        ),
    ],
)
def test_bad_values_name_the_key_and_form(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate(data)
    assert message in str(err.value)


def test_bad_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[roles.logger]\nk = -1\n")
    with pytest.raises(ConfigError, match=r"roles\.logger\.k: .* \(.*tierflow\.toml\)"):
        load(path, environ=EMPTY)
    broken = write(tmp_path, "[roles\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(broken, environ=EMPTY)
    with pytest.raises(ConfigError, match="does not exist"):
        load(tmp_path / "missing.toml", environ=EMPTY)


def test_bad_env_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match="roles.logger.k"):
        load(environ={"TIERFLOW_ROLES__LOGGER__K": "lots"})


def test_shown_config_loads_back_to_the_same(tmp_path: Path) -> None:
    cfg = load(environ={"TIERFLOW_ROLES__LOGGER__K": "2", "TIERFLOW_SPARK__CONF__spark.x": "1"})
    again = load(write(tmp_path, dumps_toml(cfg)), environ=EMPTY)
    assert again == cfg


def test_shown_config_with_jobs_loads_back_to_the_same(tmp_path: Path) -> None:
    text = """
[streams.meetup]
subjects = ["raw.meetup"]

[[jobs]]
name = "late_city"
kind = "count"
stream = "meetup"
by = ["group.group_city"]
window = { length = "1 minute", watermark = "10 minutes" }
time_field = "mtime"
"""
    cfg = load(write(tmp_path, text), environ=EMPTY)
    again = load(write(tmp_path, dumps_toml(cfg)), environ=EMPTY)
    assert again == cfg
    assert again.jobs[0]["window"]["watermark"] == "10 minutes"


@pytest.mark.parametrize(
    ("job", "error"),
    [
        ({"kind": "topn", "stream": "meetup", "field": "x"}, r"jobs\[1\]: Object missing .*`name`"),
        (
            {"name": "t", "kind": "top", "stream": "meetup"},
            r"jobs\[1\]\.kind: Invalid enum value",
        ),
        ({"name": "t", "kind": "topn", "stream": "meetup", "feild": "x"}, r"jobs\[1\]: .*`feild`"),
        ({"name": "t", "kind": "topn", "stream": "meetup", "n": 0}, r"jobs\[1\]\.n: Expected"),
        ({"name": "t", "kind": "topn", "stream": "meetup"}, r"jobs\[1\]: job 't': topn needs"),
        (
            {"name": "t", "kind": "count", "stream": "meetup", "by": ["a..b"]},
            r"jobs\[1\]: .*a\.\.b",
        ),
        (
            {"name": "t", "kind": "custom", "stream": "meetup", "function": "windows"},
            r"jobs\[1\]: .*expected 'module:function'",
        ),
        (
            {
                "name": "t",
                "kind": "count",
                "stream": "meetup",
                "by": ["a"],
                "window": {"length": "5 parsecs"},
            },
            r"jobs\[1\]: .*5 parsecs",
        ),
        (
            {"name": "t", "kind": "topn", "stream": "meetpu", "field": "x"},
            r"jobs\[1\]\.stream: no stream 'meetpu'",
        ),
        (
            {"name": "ok", "kind": "topn", "stream": "meetup", "field": "x"},
            r"jobs\[1\]\.name: 'ok' is also jobs\[0\]'s",
        ),
    ],
)
def test_a_bad_job_is_refused_as_the_config_loads_naming_its_entry(
    job: dict[str, Any], error: str
) -> None:
    good = {"name": "ok", "kind": "topn", "stream": "meetup", "field": "x"}
    meetup = {"meetup": {"subjects": ["raw.meetup"]}}
    assert validate({"streams": meetup, "jobs": [good]}).jobs == [good]
    with pytest.raises(ConfigError, match=error):
        validate({"streams": meetup, "jobs": [good, job]})


def test_jobs_may_analyse_a_users_own_stream_and_the_results_stream() -> None:
    own = {"name": "c", "kind": "count", "stream": "clicks", "by": ["page"]}
    res = {"name": "r", "kind": "count", "stream": "results", "by": ["query"]}
    cfg = validate({"streams": {"clicks": {}}, "jobs": [own, res]})
    assert [j["name"] for j in cfg.jobs] == ["c", "r"]
    with pytest.raises(ConfigError, match=r"jobs\[0\]\.stream: no stream 'meetup'"):
        validate({"streams": {"clicks": {}}, "jobs": [{**own, "stream": "meetup"}]})


def test_extra_logger_replicas_need_as_much_k() -> None:
    assert validate({"logging": {"extra_replicas": 1}}).logging.extra_replicas == 1
    with pytest.raises(ConfigError, match="logging.extra_replicas"):
        validate({"logging": {"extra_replicas": 2}})
    with pytest.raises(ConfigError, match="logging.extra_replicas"):
        validate({"roles": {"logger": {"k": 0}}, "logging": {"extra_replicas": 1}})


def test_stream_logic_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"streams\.clicks\.logic\.filter: .*line 1, column"):
        validate({"streams": {"clicks": {"logic": {"filter": "kind + 1 = 2"}}}})
    with pytest.raises(ConfigError, match=r"streams\.clicks\.logic\.validate"):
        validate({"streams": {"clicks": {"logic": {"validate": {"kind": "string-ish"}}}}})
    ok = validate({"streams": {"clicks": {"logic": {"filter": "kind != 'bot'"}}}})
    assert ok.streams["clicks"].logic.filter == "kind != 'bot'"


def test_gateway_named_filters_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.filters\.yes_only: .*"):
        validate({"gateway": {"filters": {"yes_only": "SELECT WHERE response = "}}})
    ok = validate({"gateway": {"filters": {"yes_only": "WHERE response = 'yes'"}}})
    assert ok.gateway.filters == {"yes_only": "WHERE response = 'yes'"}
    tokens = validate({"auth": {"consumer_streams": {"t1": ["results"]}}})
    assert tokens.auth.consumer_streams == {"t1": ["results"]}
