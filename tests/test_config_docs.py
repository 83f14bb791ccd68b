"""The TOML examples in the docs are real: each fenced ``toml`` block of every page is loaded
through the real loader (the edge's for ``configuration.md`` and ``quickstart.md``, the node's
for ``node.md`` and ``tunnel.md``; elsewhere the kind ``dispatcher check-config`` detects). A
block whose first lines are ``# error: <message>`` must fail with exactly those messages (the
file named as in the docs; every problem of the file, in that order); every other block must
load. (``test_check_config.py`` runs the same blocks through ``dispatcher check-config``.)"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path

import pytest

from dispatcher.config import ConfigError, load_edge_config
from dispatcher.config.summary import ConfigKind, config_kind
from nodes import load_node_config
from nodes.config import NodeConfigError

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```toml\n(.*?)^```", re.DOTALL | re.MULTILINE)
ERROR = "# error: "

ENVIRON = {
    # The variables the examples name; the error examples name others, left unset.
    "NODE_A_TOKEN": "token-a",
    "NODE_B_TOKEN": "token-b",
    "EDGE_API_KEYS": "sk-1,sk-2",
    "EDGE_ADMIN_KEYS": "admin-1",
    "EDGE_NODE_TOKENS": "node-1,node-2",
    "NODE_TOKEN": "node-secret",
    "TEAM_SEARCH_KEY": "sk-search",
    "BATCH_KEY": "sk-batch",
    "METRICS_TOKEN": "metrics-1",
    "OPENAI_API_KEY": "sk-openai",  # an edge's [[providers]] (read when its file is loaded)
    "DISPATCHER_REDIS_URL": "redis://:redis-1@redis.internal:6379/0",
    "DISPATCHER_DATABASE_URL": "postgresql://dispatcher:db-1@db.internal/dispatcher",
}

LOADERS: dict[str, ConfigKind] = {
    "configuration.md": "edge",
    "quickstart.md": "edge",
    "node.md": "node",
    "tunnel.md": "node",
    "providers.md": "node",
    "tenants.md": "edge",
    "cluster.md": "edge",
}


def examples() -> list[tuple[str, int, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((page.name, line, match.group(1)))
    return found


def expected_errors(block: str) -> list[str]:
    """The messages a block's leading ``# error: `` lines say it fails with (none: it loads)."""
    lines = block.splitlines()
    return [line.removeprefix(ERROR) for line in itertools.takewhile(is_error, lines)]


def is_error(line: str) -> bool:
    return line.startswith(ERROR)


def kind_of(doc: str, block: str) -> ConfigKind:
    """The loader a block is for: its page's, else what check-config detects."""
    try:
        return LOADERS.get(doc) or config_kind(tomllib.loads(block))
    except tomllib.TOMLDecodeError:
        return "edge"


EXAMPLES = examples()


def test_the_docs_have_examples() -> None:
    by_doc = {name: sum(1 for doc, _, _ in EXAMPLES if doc == name) for name in LOADERS}
    assert "operations.md" not in LOADERS  # both kinds: each block's is detected
    assert by_doc["configuration.md"] >= 8, by_doc
    assert by_doc["node.md"] >= 6, by_doc
    operations = [kind_of(doc, block) for doc, _, block in EXAMPLES if doc == "operations.md"]
    assert sorted(set(operations)) == ["edge", "node"], operations
    assert any(block.startswith(ERROR) for _, _, block in EXAMPLES)


@pytest.mark.parametrize(
    ("doc", "line", "block"), EXAMPLES, ids=[f"{doc}:{line}" for doc, line, _ in EXAMPLES]
)
def test_example(tmp_path: Path, doc: str, line: int, block: str) -> None:
    kind = kind_of(doc, block)
    path = tmp_path / f"{kind}.toml"
    path.write_text(block, encoding="utf-8")
    expected = expected_errors(block)
    try:
        if kind == "edge":
            load_edge_config(path, environ=ENVIRON)
        else:
            load_node_config(path, environ=ENVIRON)
    except (ConfigError, NodeConfigError) as exc:
        messages = [message.replace(f"{tmp_path}/", "") for message in exc.lines()]
        if not expected:
            pytest.fail(f"{doc}:{line}: the example does not load: {messages}")
        assert messages == expected, f"{doc}:{line}"
    else:
        assert not expected, f"{doc}:{line}: loaded, but the docs say: {expected}"
