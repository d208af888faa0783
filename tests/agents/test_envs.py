"""The built-in environments: calculator (safe AST walker), sql (real sqlite3, read-only,
interrupted by a watchdog), frozenlake; oracle transcripts reach reward 1."""

import pytest

from fastrl.agents.envs import BUILTIN_ENVS, synthetic_transcripts
from fastrl.agents.envs.calculator import CalculatorEnv, calculator_rows, safe_arithmetic
from fastrl.agents.envs.frozenlake import FrozenLakeEnv, frozenlake_rows
from fastrl.agents.envs.sql import QUESTIONS, SqlEnv, build_database, sql_rows


def test_safe_arithmetic_values():
    assert safe_arithmetic("347*58+126") == str(347 * 58 + 126)
    assert safe_arithmetic("-(2+3)**2 // 4 % 7") == str(-(2 + 3) ** 2 // 4 % 7)
    assert safe_arithmetic("7/2") == "3.5" and safe_arithmetic("8/2") == "4"


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x+1", "abs(-1)", "(1).real", "[1,2]", "'a'*3", "1 if 1 else 2",
    "9**999999", "10**101", "2**-1000", "(10**60)*(10**60)", "1/0", "1e308*10", "", "1+" * 150 + "1",
])
def test_safe_arithmetic_rejects(expression):
    with pytest.raises((ValueError, ZeroDivisionError)):
        safe_arithmetic(expression)


def test_calculator_rows_and_reward():
    train, heldout = calculator_rows(num_train=50, num_heldout=20, seed=3)
    assert len(train) == 50 and len(heldout) == 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert calculator_rows(num_train=50, num_heldout=20, seed=3) == (train, heldout)
    env = CalculatorEnv()
    env.reset(train[0], 0)
    step = env.step(f"calc({train[0]['expression']})")
    assert step.observation[0]["content"] == train[0]["answer"]
    env.step("calc(__import__('os'))")
    assert env.step(train[0]["answer"]).reward == 1.0
    env.reset(train[0], 0)
    assert env.step(str(int(train[0]["answer"]) + 1)).reward == 0.0


def test_sql_rows_are_answered_by_their_query_and_not_by_a_guess():
    train, heldout = sql_rows(num_train=200, num_heldout=20, seed=1)
    assert sql_rows(num_train=200, num_heldout=20, seed=1) == (train, heldout)
    assert not {(r["db_seed"], r["prompt"]) for r in train} & {(r["db_seed"], r["prompt"]) for r in heldout}
    for row in train[:12] + heldout[:4]:
        conn = build_database(row["db_seed"])
        assert str(conn.execute(row["sql"]).fetchone()[0]) == row["answer"]
        conn.close()
    prefixes = [sql.split("{")[0] for _, sql in QUESTIONS]
    assert all(any(row["sql"].startswith(prefix) for row in train) for prefix in prefixes)  # every kind is drawn
    answers = [row["answer"] for row in train]
    assert max(answers.count(a) for a in set(answers)) < 0.1 * len(answers)  # no constant answer scores well


@pytest.fixture
def sql_env():
    train, _ = sql_rows(num_train=3, num_heldout=0, seed=0)
    env = SqlEnv(query_timeout_s=0.2, max_rows=3, max_chars=80)
    env.reset(train[0], 0)
    yield env, train[0]
    env.close()


def test_sql_query_answers_and_truncates(sql_env):
    env, row = sql_env
    assert env.query(row["sql"]).splitlines()[-1] == row["answer"]
    many = env.query("SELECT * FROM o")
    assert many.splitlines()[0] == "cid|pid|qty"
    assert len(many.splitlines()) == 1 + 3 + 1 and "more than 3 rows" in many
    wide = env.query("SELECT o.*, c.*, p.* FROM o, c, p")
    assert wide.endswith("... (truncated)") and len(wide) == 80 + len("... (truncated)")
    assert env.query("SELEC nonsense").startswith("error: ")
    assert env.query("SELECT nope FROM c").startswith("error: ")


@pytest.mark.parametrize("statement", [
    "INSERT INTO c VALUES (99, 'Zed', 'Oslo')",
    "DELETE FROM o",
    "UPDATE p SET price = 0",
    "DROP TABLE o",
    "CREATE TABLE t(x)",
    "ATTACH DATABASE ':memory:' AS other",
    "PRAGMA query_only = OFF",
])
def test_sql_is_read_only(sql_env, statement):
    env, row = sql_env
    before = env.query("SELECT COUNT(*), SUM(qty) FROM o")
    assert env.query(statement).startswith("error: ")
    assert env.query("SELECT COUNT(*), SUM(qty) FROM o") == before
    assert env.query(row["sql"]).splitlines()[-1] == row["answer"]


def test_sql_watchdog_interrupts_a_query_that_never_ends(sql_env):
    env, row = sql_env
    endless = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT COUNT(*) FROM n"
    assert "took longer than 0.2 s" in env.query(endless)
    assert env.query(row["sql"]).splitlines()[-1] == row["answer"]  # the connection still works


def test_sql_tool_through_the_step(sql_env):
    env, row = sql_env
    step = env.step(f"query({row['sql']})")
    assert step.observation[0]["name"] == "query" and step.observation[0]["content"].splitlines()[-1] == row["answer"]
    assert env.step(row["answer"]).reward == 1.0


def test_frozenlake_moves_states_and_rewards():
    row = {"prompt": "p", "grid": ["..G", ".H.", "..."], "start": [2, 0], "answer": "4"}
    env = FrozenLakeEnv()
    env.reset(row, 0)
    down = env.step("down")  # into the border: same state
    assert not down.done and down.observation[0]["content"] == "..G\n.H.\nA.."
    assert env.step("I go down").info["state_key"] == down.info["state_key"]
    bad = env.step("jump")
    assert bad.info["tool_failures"] == {"bad_format": 1} and bad.info["state_key"] == down.info["state_key"]
    assert env.step("right").info["state_key"] != down.info["state_key"]
    hole = env.step("up")
    assert hole.done and hole.reward == 0.0 and hole.info["stop_reason"] == "hole"
    env.reset(row, 0)
    for move in FrozenLakeEnv.solve(row)[:-1]:
        assert not env.step(move["move"]).done
    goal = env.step(FrozenLakeEnv.solve(row)[-1]["move"])
    assert goal.done and goal.reward == 1.0


def test_frozenlake_rows_are_solvable_and_distinct():
    train, heldout = frozenlake_rows(num_train=30, num_heldout=10, seed=1)
    keys = {(tuple(r["grid"]), tuple(r["start"])) for r in train + heldout}
    assert len(keys) == 40 and all(int(r["answer"]) >= 1 for r in train)


@pytest.mark.parametrize("name", list(BUILTIN_ENVS))
@pytest.mark.parametrize("call_format", ["compact", "hermes"])
def test_synthetic_transcripts_are_real_episodes_with_reward_1(name, call_format):
    rows, _ = BUILTIN_ENVS[name].rows(num_train=5, num_heldout=0, seed=2)
    pairs = synthetic_transcripts(name, rows, call_format=call_format)  # raises unless the oracle scores 1
    assert len(pairs) == 5
    for (prompt, transcript), row in zip(pairs, rows):
        assert prompt[0]["content"] == row["prompt"]
        assert transcript[0]["role"] == transcript[-1]["role"] == "assistant"
        if BUILTIN_ENVS[name].uses_tools:
            assert transcript[1]["role"] == "tool" and transcript[-1]["content"] == row["answer"]
    assert synthetic_transcripts(name, rows, call_format=call_format) == pairs
