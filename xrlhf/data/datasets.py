"""Row datasets (JSONL or parquet) for offline algorithms and prompt environments.

Why a module: DPO, offline KTO, reward-model training and the Q&A environment all read small
tables of text fields, and a user's file with one bad row should fail with one line naming
the file, the line (or parquet row) and what is wrong, before any model is loaded, not with
a pyarrow traceback halfway through training. Files are read through the ``datasets``
library (``load_dataset("json" | "parquet", data_files=...)``), never from the hub.

The row formats (``RowSchema``)::

    preference  {"prompt": str, "chosen": str, "rejected": str}     DPO, reward model
    kto         {"prompt": str, "completion": str, "label": bool}   offline KTO
    prompt      {"prompt": str, "answer": str (optional)}           the ``qa`` environment

Extra fields are allowed and ignored. ``xrlhf make-dataset`` writes all three formats.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Sequence, TypeVar

from pydantic import AfterValidator

from xrlhf.utils.errors import UserError, first_line

T = TypeVar("T")

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix -> ``datasets`` builder."""


@dataclass(frozen=True)
class RowSchema:
    """The fields a row must (and may) have, with their types.

    Attributes:
        kind: the format's name, used in messages and in ``xrlhf make-dataset KIND``.
        required: field -> type (``str`` or ``bool``).
        optional: fields that may be missing or null.
    """

    kind: str
    required: dict[str, type]
    optional: dict[str, type] = field(default_factory=dict)


PREFERENCE = RowSchema("preferences", {"prompt": str, "chosen": str, "rejected": str})
KTO = RowSchema("kto", {"prompt": str, "completion": str, "label": bool})
PROMPTS = RowSchema("qa", {"prompt": str}, {"answer": str})
COMPLETIONS = RowSchema("completions", {"prompt": str, "completion": str})
"""A teacher's (or any reference's) completions of prompts: distillation's off-policy rows."""


@dataclass
class Rows:
    """The validated rows of one file, and where each came from.

    Attributes:
        path: the file.
        rows: one dict per row with the schema's fields (``label`` as ``bool``).
        lines: for JSONL, the 1-based line of each row; empty for parquet.
    """

    path: str
    rows: list[dict[str, Any]]
    lines: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def where(self, i: int) -> str:
        """``path:LINE`` (JSONL) or ``path: row I`` (parquet, 0-based) of row ``i``."""
        return f"{self.path}:{self.lines[i]}" if self.lines else f"{self.path}: row {i}"


def _check_dataset_file(v: str | None) -> str | None:
    if v is None:
        return v
    p = Path(v).expanduser()
    if p.suffix not in FORMATS:
        raise ValueError(f"{v!r}: a dataset must be a .jsonl, .json or .parquet file")
    if not p.is_file():
        if Path(v).parts[:2] == ("artifacts", "data"):  # where the shipped configs' datasets are built
            raise ValueError(f"no such file {v!r} (build the datasets of the shipped configs with: xrlhf prepare-data)")
        raise ValueError(f"no such file {v!r} (generate one with: xrlhf make-dataset "
                         f"{{preferences,kto,qa}} {v}, see docs/algorithms.md)")
    return str(p.resolve())


DatasetPath = Annotated[str, AfterValidator(_check_dataset_file)]
"""A local JSONL / parquet file, validated to exist when the config is validated."""


def load_rows(path: str | Path, schema: RowSchema) -> Rows:
    """Read ``path`` with ``datasets`` and validate every row against ``schema``.

    Raises:
        UserError: ``path:LINE: <problem>`` for the first bad row (missing or null field,
            wrong type, malformed JSON), or ``path: ...`` for an unreadable or empty file.
    """
    path = str(path)
    suffix = Path(path).suffix
    if suffix not in FORMATS:
        raise UserError(f"{path}: a dataset must be a .jsonl, .json or .parquet file")
    if not Path(path).is_file():
        raise UserError(f"{path}: no such file")
    lines = _jsonl_lines(path, schema) if FORMATS[suffix] == "json" else []
    if FORMATS[suffix] == "json" and not lines:
        raise UserError(f"{path}: no rows (a {schema.kind} row looks like {_example(schema)})")
    table = _read_table(path, FORMATS[suffix], schema)
    out = Rows(path, [], lines)
    for i, raw in enumerate(table):
        out.rows.append(_validate_row(raw, schema, lambda: out.where(i)))
    if not out.rows:
        raise UserError(f"{path}: no rows (a {schema.kind} row looks like {_example(schema)})")
    return out


def _read_table(path: str, builder: str, schema: RowSchema) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # noqa: BLE001 - pyarrow / pandas errors of many kinds
        raise UserError(f"{path}: cannot be read as {builder} ({first_line(e)})") from None
    return ds.to_list()


def dataset_errors(path: str | Path, schema: RowSchema, limit: int = 10) -> list[str]:
    """Every problem of the file, one line each (``path:LINE: ...``), at most ``limit`` of them
    and then a count of the rest: what ``xrlhf validate`` reports, where ``load_rows`` stops
    at the first."""
    path = str(path)
    builder = FORMATS.get(Path(path).suffix)
    if builder is None or not Path(path).is_file():
        return []  # the config's DatasetPath check reported it
    errors: list[str] = []
    try:
        if builder == "json":
            if not _jsonl_lines(path, schema, errors) and not errors:
                errors.append(f"{path}: no rows (a {schema.kind} row looks like {_example(schema)})")
        else:
            for i, raw in enumerate(_read_table(path, builder, schema)):
                try:
                    _validate_row(raw, schema, lambda: f"{path}: row {i}")  # noqa: B023 - called right away
                except UserError as e:
                    errors.append(e.messages[0])
    except UserError as e:
        errors += e.messages
    if len(errors) > limit:
        errors = errors[:limit] + [f"{path}: ... and {len(errors) - limit} more bad rows"]
    return errors


def _jsonl_lines(path: str, schema: RowSchema, errors: list[str] | None = None) -> list[int]:
    """The line number of each row, checking every line against ``schema`` on the way
    (``errors``: collect every problem there instead of raising at the first).

    Trailing blank lines are allowed (``datasets`` skips them), blank lines between rows are
    not. The check is done here, before ``datasets`` reads the file, so that a malformed line
    or a wrong type is reported by its line number instead of by pyarrow's message (pyarrow
    also fails on some valid files whose columns mix types).

    Raises:
        UserError: ``path:LINE: <problem>``.
    """
    lines: list[int] = []
    blank = 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                blank = blank or n
                continue
            try:
                _check_line(path, n, line, blank, schema)
                lines.append(n)
            except UserError as e:
                if errors is None:
                    raise
                errors += e.messages
            blank = 0
    return lines


def _check_line(path: str, n: int, line: str, blank: int, schema: RowSchema) -> None:
    if blank:
        raise UserError(f"{path}:{blank}: blank line between rows; remove it (JSONL is one "
                        f"object per line)")
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno}); each line "
                        f"must be one object like {_example(schema)}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path}:{n}: a row must be a JSON object like {_example(schema)}, "
                        f"got {type(value).__name__}")
    _validate_row(value, schema, lambda: f"{path}:{n}")


def _validate_row(raw: dict[str, Any], schema: RowSchema, where) -> dict[str, Any]:
    row = {}
    for name, kind in {**schema.required, **schema.optional}.items():
        value = raw.get(name)
        if value is None:
            if name in schema.required:
                raise UserError(f"{where()}: missing field {name!r} (a {schema.kind} row needs "
                                f"{', '.join(schema.required)}: {_example(schema)})")
            row[name] = None
            continue
        row[name] = _coerce(value, kind, name, where)
    return row


def _coerce(value: Any, kind: type, name: str, where) -> Any:
    if kind is bool:
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise UserError(f"{where()}: field {name!r} must be true or false (or 1 / 0), got {value!r}")
    if not isinstance(value, str):
        raise UserError(f"{where()}: field {name!r} must be a string, got {value!r}")
    return value


def _example(schema: RowSchema) -> str:
    sample = {"prompt": "2+3=", "chosen": "5", "rejected": "6", "completion": "5", "label": True, "answer": "5"}
    return json.dumps({k: sample[k] for k in schema.required})


def held_out(text: str, fraction: float) -> bool:
    """Whether a row keyed by ``text`` belongs to a deterministic held-out split.

    A hash of the text, not the row's position, decides: the split does not change when the
    file is shuffled or the seed changes, and duplicate prompts land on the same side.
    """
    return zlib.crc32(text.encode()) % 10_000 < round(fraction * 10_000)


def split_held_out(items: Sequence[T], keys: Sequence[str], fraction: float, *, path: str, section: str,
                   noun: str) -> tuple[list[T], list[T]]:
    """``items`` cut into (training, held-out) by ``held_out(key, fraction)`` of each item's key.

    Args:
        items: the rows (or their encodings); keys: one text per item (its prompt).
        path, section, noun: for the message when a side is empty: the dataset file, the YAML
            section holding ``eval_fraction`` / ``eval_dataset`` (``env.options``,
            ``algorithm``) and what the rows are (``prompts``, ``pairs``).
    Raises:
        UserError: when either side is empty.
    """
    train = [x for x, k in zip(items, keys) if not held_out(k, fraction)]
    evals = [x for x, k in zip(items, keys) if held_out(k, fraction)]
    if not train or not evals:
        raise UserError(f"{path}: {section}.eval_fraction {fraction} leaves {len(train)} training and "
                        f"{len(evals)} held-out {noun}; change it or give {section}.eval_dataset")
    return train, evals


class EpochOrder:
    """An endless stream over ``n`` rows: position ``i`` is row ``order(i // n)[i % n]``, each
    epoch a fresh shuffle seeded by ``(seed, salt, epoch)``.

    Why: a run's data position is then one integer (saved in checkpoints), and the row at any
    position is a pure function of the seed, so a resumed run reads what an uninterrupted run
    would. One epoch's order is cached at a time.
    """

    def __init__(self, n: int, seed: int, salt: str):
        if n < 1:
            raise ValueError("EpochOrder needs at least one row")
        self.n, self.seed, self.salt = n, seed, salt
        self._epoch, self._order = -1, []

    def order(self, epoch: int) -> list[int]:
        """The row indices of ``epoch`` in the order they are visited."""
        if epoch != self._epoch:
            self._order = list(range(self.n))
            random.Random(f"{self.seed}/{self.salt}/{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order

    def take(self, start: int, count: int) -> list[int]:
        """The rows at positions ``start .. start + count - 1``."""
        if start < 0 or count < 0:
            raise ValueError(f"EpochOrder.take(start={start}, count={count}) needs both >= 0")
        return [self.order(i // self.n)[i % self.n] for i in range(start, start + count)]


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` as JSON lines (parent directories created)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return p
