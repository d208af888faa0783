"""``sql``: an in-memory ``sqlite3`` shop database generated from a seed (customers ``c``,
products ``p``, orders ``o``), questions whose answer needs a query (a lookup, a sum over one
or two joins), one read-only ``query(sql)`` tool; reward 1.0 for the exact answer.

The tool's safety: the connection has an authorizer that allows only reading (``SELECT``,
reads of columns, functions, recursive CTEs; every write, ``ATTACH``, ``PRAGMA`` and DDL is denied) and
``PRAGMA query_only``; a watchdog thread calls ``conn.interrupt()`` after
``query_timeout_s`` (the observation then says the query timed out); results are cut to
``max_rows`` rows and ``max_chars`` characters; SQL errors are returned as observations.
Rows: ``{"prompt", "answer", "db_seed", "sql"}`` from :func:`sql_rows` (``sql``: a reference
query that answers the question; the oracle uses it).
"""

from __future__ import annotations

import random
import sqlite3
import threading

from fastrl.agents.env import Message
from fastrl.agents.tool_env import ToolEnv

__all__ = ["SqlEnv", "sql_rows", "build_database", "SCHEMA_TEXT", "QUESTIONS"]

_NAMES = ["Ann", "Bob", "Cy", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kim", "Lu"]
_CITIES = ["Oslo", "Rome", "Lima", "Kyiv", "Pune"]
_PRODUCTS = ["pen", "cup", "hat", "map", "box", "fan", "jar", "mug"]
_TABLES = (
    "CREATE TABLE c(id INTEGER PRIMARY KEY, name TEXT, city TEXT);"
    "CREATE TABLE p(id INTEGER PRIMARY KEY, name TEXT, price INTEGER);"
    "CREATE TABLE o(cid INTEGER REFERENCES c(id), pid INTEGER REFERENCES p(id), qty INTEGER);"
)
"""Customers ``c``, products ``p``, orders ``o`` (``o.cid -> c.id``, ``o.pid -> p.id``). The
names are short on purpose: the built-in tokenizer is one token per character, and every
character of a query is one the tiny model has to produce."""
SCHEMA_TEXT = "c(id,name,city) p(id,name,price) o(cid,pid,qty)"
"""The schema as the prompt shows it (customers, products, orders)."""
NUM_CUSTOMERS, NUM_PRODUCTS, NUM_ORDERS = 6, 5, 15
"""Rows of each table of one database."""

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
"""What the authorizer allows: reading, functions, recursive CTEs (read-only too)."""


def build_database(db_seed: int) -> sqlite3.Connection:
    """A fresh in-memory database filled from ``db_seed`` (same seed, same rows)."""
    rng = random.Random(db_seed)
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.executescript(_TABLES)
    names = rng.sample(_NAMES, NUM_CUSTOMERS)
    conn.executemany("INSERT INTO c VALUES (?,?,?)", [(i + 1, n, rng.choice(_CITIES)) for i, n in enumerate(names)])
    products = rng.sample(_PRODUCTS, NUM_PRODUCTS)
    conn.executemany("INSERT INTO p VALUES (?,?,?)", [(i + 1, n, rng.randint(2, 40)) for i, n in enumerate(products)])
    conn.executemany(
        "INSERT INTO o VALUES (?,?,?)",
        [(rng.randint(1, NUM_CUSTOMERS), rng.randint(1, NUM_PRODUCTS), rng.randint(1, 9)) for _ in range(NUM_ORDERS)],
    )
    conn.commit()
    return conn


QUESTIONS = (
    ("How many {product}s were ordered?", "SELECT SUM(qty) FROM o,p WHERE pid=p.id AND name='{product}'"),
    ("What did {product}s earn?", "SELECT SUM(qty*price) FROM o,p WHERE pid=p.id AND name='{product}'"),
    ("How many items did {name} buy?", "SELECT SUM(qty) FROM o,c WHERE cid=c.id AND name='{name}'"),
    ("How much did {name} spend?", "SELECT SUM(qty*price) FROM o,p,c WHERE pid=p.id AND cid=c.id AND c.name='{name}'"),
)
"""``(question, reference query)`` templates: a sum over the orders joined to one or both other
tables. Every answer is read from the database and none is a small count a model could
guess (1-9 items per order over the orders of one of 6 customers or 5 products; revenue and
spend in the tens to hundreds). The kinds are of a similar length, so a warm-up that reaches
its target has learnt all of them a little (a one-table lookup would be learnt first and
alone)."""


def sql_rows(*, num_train: int, num_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` questions, each on its own seeded database; answers computed by the
    reference query (a question whose sum is over no orders is drawn again)."""
    rng = random.Random(seed)
    rows = []
    seen: set[tuple[int, str]] = set()
    while len(rows) < num_train + num_heldout:
        db_seed = rng.randrange(10**9)
        conn = build_database(db_seed)
        names = [r[0] for r in conn.execute("SELECT name FROM c")]
        products = [r[0] for r in conn.execute("SELECT name FROM p")]
        question, sql = rng.choice(QUESTIONS)
        fill = {"name": rng.choice(names), "product": rng.choice(products)}
        question, sql = question.format(**fill), sql.format(**fill)
        answer = conn.execute(sql).fetchone()[0]
        conn.close()
        if answer is None or (db_seed, question) in seen:
            continue
        seen.add((db_seed, question))
        prompt = f"Tables: {SCHEMA_TEXT}\nQ: {question}"
        rows.append({"prompt": prompt, "answer": str(answer), "db_seed": db_seed, "sql": sql})
    return rows[num_heldout:], rows[:num_heldout]


def _read_only(action: int, *args: object) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


class SqlEnv(ToolEnv):
    """One question per episode on its own database; ``query`` runs read-only SQL.

    Args:
        query_timeout_s: wall-clock limit of one query (a watchdog thread interrupts it).
        max_rows: rows shown of a result.
        max_chars: characters shown of a result.
        call_format, max_repeated_calls, calls_in_reasoning: as for ``ToolEnv``.
    """

    def __init__(self, *, query_timeout_s: float = 1.0, max_rows: int = 10, max_chars: int = 400,
                 call_format: str = "compact", max_repeated_calls: int | None = 3,
                 calls_in_reasoning: bool = False) -> None:
        super().__init__(call_format=call_format, max_repeated_calls=max_repeated_calls, calls_in_reasoning=calls_in_reasoning)
        self.query_timeout_s = query_timeout_s
        self.max_rows = max_rows
        self.max_chars = max_chars
        self.conn: sqlite3.Connection | None = None
        self.row: dict = {}
        self.tools = [self.query]

    def reset(self, row: dict, seed: int) -> list[Message]:
        self.begin_episode()
        self.close()
        self.row = row
        self.conn = build_database(int(row["db_seed"]))
        self.conn.execute("PRAGMA query_only = ON")
        self.conn.set_authorizer(_read_only)
        return [{"role": "user", "content": row["prompt"]}]

    def query(self, sql: str) -> str:
        """Run a read-only SQL query on the database.

        Args:
            sql: one SELECT statement
        """
        assert self.conn is not None, "query() before reset()"
        timer = threading.Timer(self.query_timeout_s, self.conn.interrupt)
        timer.start()
        try:
            cursor = self.conn.execute(sql)
            rows = cursor.fetchmany(self.max_rows + 1)
            columns = [d[0] for d in cursor.description or ()]
        except sqlite3.OperationalError as error:
            if "interrupted" in str(error):
                return f"error: the query took longer than {self.query_timeout_s:g} s and was stopped"
            return f"error: {error}"
        except (sqlite3.Error, sqlite3.Warning) as error:
            return f"error: {error}"
        finally:
            timer.cancel()
        lines = ["|".join(columns)] + ["|".join(str(v) for v in r) for r in rows[: self.max_rows]]
        if len(rows) > self.max_rows:
            lines.append(f"... (more than {self.max_rows} rows)")
        text = "\n".join(lines)
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + "... (truncated)"
        return text

    def score(self, answer: str) -> float:
        return 1.0 if answer.strip() == self.row["answer"] else 0.0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    @staticmethod
    def solve(row: dict) -> list[dict]:
        """The oracle: the reference query, then the answer."""
        return [{"call": ("query", {"sql": row["sql"]})}, {"answer": row["answer"]}]
