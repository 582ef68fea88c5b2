"""Source comments and docstrings give reasons that stay true: no dates, no description of the
machine the code was written on, no test names, no issue numbers and no measured figures.

Why: a figure measured once on one machine is wrong on the next one and stale after the next
change, yet a comment keeps stating it; a test name or an issue number sends the reader elsewhere
for the reason instead of giving it. Figures, with their date and machine, belong in
docs/benchmarks.md; the history of a change in its commit message. Limits and defaults stated as
design ("a 30 s timeout", "4 KiB frames") are not measurements and pass.

Comments are read with :mod:`tokenize` (consecutive comment lines as one text, so a phrase broken
across lines is still seen) and module, class and function docstrings with :mod:`ast`. The
checker is proven on synthetic sources that break each rule, and on design constants that must
pass, before it is applied to ``laminar/``, ``roles/`` and ``transport/``.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = [REPO / "laminar", REPO / "roles", REPO / "transport"]

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)

#: a figure: a number, possibly approximate (``~``) or a range (``496-633``)
_NUM = r"~?\d[\d,]*(?:\.\d+)?(?:\s?(?:-|\u2013|to)\s?\d[\d,]*(?:\.\d+)?)?"

#: what a measured time or rate is counted in
_PACE = (
    r"(?:ms|µs|us|ns|s|secs?|seconds?|min|minutes?|h|hours?|CPU-s|core-s"
    r"|[KMGT]i?B/s|[KMG]bit/s|tok/s|tokens/s|tokens per second|calls/s|steps/s)"
)

#: what any measured figure is counted in: a time or rate, a size, a share, a ratio
_UNIT = rf"(?:{_PACE}|[KMGT]i?B|%|x\s(?:faster|slower|less|more)|times\s(?:faster|slower))"

#: words that present the figure after them as the outcome of a run
_MEASURED = (
    r"\b(?:measured|measuring|measurements?|took|ran|strace|benchmarked|profiled|profiling"
    r"|py-spy|timed(?! out)|counted|clocked|came to|went from|dropped|fell|rose|cost(?! model| per)"
    r"|seen|observed)\b"
)

#: statistics of runs: a figure after them is measured when it is a time or a rate (a length
#: distribution's median is a parameter)
_STATISTIC = r"\b(?:median|medians|p50|p90|p95|p99|averaged?|on average)\b"

#: text within one clause (a decimal point does not end it): up to 80 characters between a
#: measuring word and its figure, up to 40 between a figure and where it was found
_CLAUSE = r"(?:[^.;!?]|\.(?=\d))"
_GAP = rf"{_CLAUSE}{{0,80}}?"
_NEAR = rf"{_CLAUSE}{{0,40}}?"

#: how two figures are set against each other
_VERSUS = r"(?:against|vs\.?|versus)"

#: where a figure starts and ends (not inside a word, a version or an address)
_START = r"(?<![\w.])"
_END = r"(?![\w/]|\.\d)"

RULES: dict[str, list[re.Pattern[str]]] = {
    "date": [
        re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
        re.compile(rf"\b{_MONTH}\.?\s+(?:[0-3]?\d(?:st|nd|rd|th)?,?\s+)?20\d\d\b"),
        re.compile(rf"\b[0-3]?\d\s+{_MONTH}\.?\s+20\d\d\b"),
        re.compile(
            r"\b(?:yesterday|last (?:session|week|night|month)|this (?:session|week|morning)"
            r"|earlier today|as of today|today's (?:code|run|figures?|numbers?|suite))\b",
            re.IGNORECASE,
        ),
    ],
    "machine": [
        re.compile(r"\b(?:2|two)[- ](?:v?cores?|v?CPUs?)\b", re.IGNORECASE),
        re.compile(r"\b(?:this|our|the dev(?:elopment)?) (?:machine|VM|box|laptop)s?\b"),
        re.compile(r"\bthis host's CPUs?\b"),
        re.compile(r"\b(?:this|the) project's (?:machines?|VMs?)\b"),
        re.compile(r"\bH200\b"),
        re.compile(r"\b(?:a|the|one) (?:fresh-clone )?CI run\b"),
    ],
    "test name": [
        re.compile(r"\btest_[a-z0-9_]+"),
        re.compile(r"\btests/[\w./-]*\.py\b"),
    ],
    "issue number": [
        re.compile(r"\b(?:issues?|PR|pull request|bug|ticket)[ -]?#?\d+\b", re.IGNORECASE),
        re.compile(r"\bgh-\d+\b"),
        re.compile(r"(?<![\w&/#])#\d+\b"),
    ],
    "measured figure": [
        # a figure presented as the outcome of a run: "took 576 s", "strace counted 4.6 per call"
        re.compile(rf"{_MEASURED}{_GAP}{_START}{_NUM}\s?{_UNIT}{_END}", re.IGNORECASE),
        re.compile(rf"{_MEASURED}{_GAP}{_START}~?\d+\.\d+{_END}", re.IGNORECASE),
        re.compile(rf"{_STATISTIC}{_GAP}{_START}{_NUM}\s?{_PACE}{_END}", re.IGNORECASE),
        re.compile(rf"\btakes (?:about |around |roughly |~){_NUM}\s?{_UNIT}{_END}"),
        # a figure followed by where or how it was found: "7 s of one core here", "0.49 µs, measured"
        re.compile(
            rf"{_START}{_NUM}\s?{_UNIT}{_END}{_NEAR}\b(?:here|measured|seen|in a profile|profiled)\b"
        ),
        # CPU time is spent, never designed
        re.compile(rf"{_START}{_NUM}\s?(?:CPU|core)-s\b"),
        # two figures set against each other: "576 s against 516 s", "5 against 1.6 µs"
        re.compile(rf"{_START}{_NUM}\s?{_UNIT}\s{_VERSUS}\s{_NUM}{_END}"),
        re.compile(rf"{_START}{_NUM}\s{_VERSUS}\s{_NUM}\s?{_UNIT}{_END}"),
        # a speed-up ratio: "1.31x", "3x faster"
        re.compile(rf"{_START}\d+\.\d+x\b"),
        re.compile(rf"{_START}\d+(?:\.\d+)?\s?(?:x|times) (?:faster|slower)\b"),
    ],
}


@dataclass(frozen=True)
class Text:
    """A comment block or a docstring: its lines joined with spaces, and where each line starts
    in the joined text (to name the line a hit is on)."""

    line: int  # of the first piece
    pieces: tuple[tuple[int, str], ...]  # (source line, its text)

    @property
    def joined(self) -> str:
        return " ".join(text for _, text in self.pieces)

    def line_at(self, offset: int) -> int:
        start = 0
        for line, text in self.pieces:
            start += len(text) + 1
            if offset < start:
                return line
        return self.pieces[-1][0]


@dataclass(frozen=True)
class Hit:
    line: int
    rule: str
    found: str

    def show(self, path: str) -> str:
        return f"{path}:{self.line}: {self.rule}: {self.found!r}"


def comment_texts(source: str) -> list[Text]:
    """Every comment, consecutive comment lines (one under the other) as one text."""
    blocks: list[list[tuple[int, str]]] = []
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        text = token.string.lstrip("#").lstrip(":").strip()
        if blocks and blocks[-1][-1][0] == line - 1:
            blocks[-1].append((line, text))
        else:
            blocks.append([(line, text)])
    return [Text(block[0][0], tuple(block)) for block in blocks]


def docstring_texts(source: str) -> list[Text]:
    """The module's docstring and every class's and function's, at any depth."""
    found: list[Text] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is None:
            continue
        first = node.body[0].lineno  # the docstring's expression: where its text starts
        lines = doc.split("\n")
        found.append(Text(first, tuple((first + i, text.strip()) for i, text in enumerate(lines))))
    return found


def history_in(source: str) -> list[Hit]:
    """What the comments and docstrings of one source say that is history, not a reason."""
    hits: set[Hit] = set()
    for text in comment_texts(source) + docstring_texts(source):
        joined = text.joined
        for rule, patterns in RULES.items():
            for pattern in patterns:
                for match in pattern.finditer(joined):
                    hits.add(Hit(text.line_at(match.start()), rule, match.group(0)))
    return sorted(hits, key=lambda hit: (hit.line, hit.rule, hit.found))


def sources() -> Iterator[Path]:
    for root in ROOTS:
        yield from sorted(root.rglob("*.py"))


# -- the checker, on sources that break each rule and on design constants that pass ------------


def _rules_hit(source: str) -> set[str]:
    return {hit.rule for hit in history_in(source)}


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("figures of 2026-11-28", "date"),
        ("as of March 2026 the engine", "date"),
        ("since Nov. 29, 2026", "date"),
        ("fixed yesterday", "date"),
        ("slow in last session's run", "date"),
        ("a third worker fills the 2 cores", "machine"),
        ("on two cores the engine spins", "machine"),
        ("a 2-core VM", "machine"),
        ("this machine has no GPU", "machine"),
        ("as on this VM", "machine"),
        ("set on this project's machines", "machine"),
        ("our machine is slow", "machine"),
        ("one H200", "machine"),
        ("a fresh-clone CI run once read exactly that", "machine"),
        ("see test_publish_order", "test name"),
        ("tests/unit/test_relay.py covers it", "test name"),
        ("tests/conftest.py orders them", "test name"),
        ("issue 16's goal", "issue number"),
        ("the issue-58 cleanup", "issue number"),
        ("fixed in #123", "issue number"),
        ("see Issue #7", "issue number"),
        ("measured on a shared runner, the suite took 576 s", "measured figure"),
        ("strace counted 4.6 per call", "measured figure"),
        ("asyncio.timeout cost 5 µs against 1.6", "measured figure"),
        ("the median was 142 µs", "measured figure"),
        ("576 s against 516 s", "measured figure"),
        ("collecting: 1.31x", "measured figure"),
        ("the heap engine is 3x faster", "measured figure"),
        ("which took ~13% off the ratio", "measured figure"),
        ("a 256 MiB transfer takes ~0.5 s", "measured figure"),
        ("profiled: 0.50 s per second waiting", "measured figure"),
        ("whose bookkeeping cost the rollout 7% of its CPU", "measured figure"),
        ("py-spy: 40% in msgpack", "measured figure"),
        ("throughput fell to 0.68 of the bare engine's", "measured figure"),
        ("about 7 s of one core here, per rank", "measured figure"),
        ("0.49 µs for a two-field model, measured", "measured figure"),
        ("aiohttp's import alone was ~0.25 CPU-s", "measured figure"),
        ("one run was seen blocking it 2 s", "measured figure"),
        ("a thread hop per request, 10% of its CPU in a profile", "measured figure"),
    ],
)
def test_the_checker_sees_each_kind_of_history(text: str, rule: str) -> None:
    as_comment = f"x = 1  # {text}\n"
    as_docstring = f'def f() -> None:\n    """Does f.\n\n    And {text}.\n    """\n'
    assert rule in _rules_hit(as_comment), as_comment
    assert rule in _rules_hit(as_docstring), as_docstring


@pytest.mark.parametrize(
    "text",
    [
        "a 30 s timeout, then SIGKILL",
        "4 KiB frames; 256 MiB buffers",
        "waits at most 2 s for the reply",
        "every 16 tokens, so each step takes a lock once",
        "the trainer takes a batch of 64 and a learning rate of 1e-6",
        "a machine of the cluster; each host runs its roles",
        "run on a machine with two GPUs",
        "pytest_addoption is the plugin's hook",
        "the test suite's fixtures",
        "rank 0 publishes; version 3 follows 2",
        "the median of the last 5 step times",
        "x = 0.5 * y",
        "a 2x margin over the longest step",
        "the benchmark keeps within 15% of the model",
        "the paper's median 1024, sigma 0.5 + 25% long",
        "over 127.0.0.1 on port 8000",
        "timed out after 5 s",
        "a cost model: 2 s per update",
        "a fixed cost per update: 2 s",
        "piped output (CI, log files) gets wide lines",
        "loopback on a small dev box measures the CPU, not the network",
        "no pidfds on a kernel before 5.3; CPython 3.11's wait_for",
        "with a 152k vocabulary that is 6 GB per copy for a micro-batch of 10k tokens",
        "the roofline of the paper's Fig. 4: 7 / 12.5 / 18 / 30 ms at batch 1 / 64 / 128 / 256",
    ],
)
def test_the_checker_passes_design_constants(text: str) -> None:
    as_comment = f"x = 1  # {text}\n"
    as_docstring = f'def f() -> None:\n    """Does f: {text}."""\n'
    assert history_in(as_comment) == [], as_comment
    assert history_in(as_docstring) == [], as_docstring


def test_the_checker_names_the_line_of_a_phrase_broken_across_lines() -> None:
    source = (
        '"""The module.\n\nThree workers on two\ncores.\n"""\n'
        "\n"
        "x = 1  # the first line of a comment\n"
        "# whose second line names tests/unit/test_x.py\n"
    )
    found = {(hit.line, hit.rule) for hit in history_in(source)}
    assert found == {(3, "machine"), (8, "test name")}


def test_the_checker_reads_nested_docstrings_and_not_strings() -> None:
    source = (
        "class A:\n"
        '    """A."""\n'
        "\n"
        "    def f(self) -> str:\n"
        '        """Measured: 4.6x."""\n'
        '        return "test_a on 2026-01-01, issue 5, 2 cores"\n'
    )
    assert [(hit.line, hit.rule) for hit in history_in(source)] == [(5, "measured figure")]


# -- the real tree -------------------------------------------------------------------------------


def test_comments_and_docstrings_give_reasons_not_history() -> None:
    found = [
        hit.show(str(path.relative_to(REPO)))
        for path in sources()
        for hit in history_in(path.read_text())
    ]
    assert found == [], (
        "comments and docstrings say why, in terms that stay true (figures with their date and "
        "machine go to docs/benchmarks.md, history to the commit message):\n" + "\n".join(found)
    )
