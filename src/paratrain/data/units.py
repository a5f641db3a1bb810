"""Work units: a corpus cut into pieces that processes can read and encode independently.

A unit is a file, a parquet row group, a record batch of a save_to_disk .arrow file, a part of
a long .jsonl file (whole lines), or a piece of a long text file. Units are grouped into chunks of consecutive units (a chunk is what
one process reads or encodes at a time, and one token shard), so the work is parallel whatever
the document sizes: a corpus of a few huge files and one of many small ones both give every
process chunks of about the same size.

A long text document is read in pieces cut where the tokenizer's own pre-tokenization gives the
same pre-tokens cut as whole (after a newline, before a printable ASCII character, checked on
the text around the cut), so the pieces' token ids joined are the whole document's ids: BPE
merges never cross a pre-token. A reader yields *fragments* `(text, ends_document)`: one per document,
or one per piece of a long one, the last piece ending it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

from .corpus import Corpus, budgeted
from .saved_dataset import batch_count

# a text file longer than this is read in pieces of about this size (the tokenizer holds ~140 bytes
# per byte of text it encodes at once: 1 MiB costs ~150 MB)
PIECE_BYTES = 2**20
CHUNK_MAX_BYTES = 64 * 2**20  # a chunk (a shard) holds at most about this much text ...
CHUNKS_PER_PROCESS = 4  # ... and at least this many chunks per process when the corpus allows
_WINDOW = 256  # bytes each side of a cut that the pre-tokenizer check looks at
_BLANKS = b" \t\r\n\x0b\x0c"  # a newline after one of these is no place to cut (a run of them)
_SCAN = 1 << 16  # bytes read at a time while looking for a cut

Fragment = Tuple[str, bool]  # (text, whether it ends its document)


@dataclass(frozen=True)
class Unit:
    file: int  # index into corpus.files
    part: int = 0  # row group, record batch or text piece
    parts: int = 1  # text files: how many pieces (1: read whole)
    nbytes: int = 0  # about how much text it holds (for sizing chunks)
    piece_bytes: int = PIECE_BYTES  # text pieces: the nominal length of each


def plan_units(corpus: Corpus, pieces: bool, piece_bytes: int = PIECE_BYTES) -> List[Unit]:
    """Every unit of the corpus in reading order. `pieces`: text files longer than
    `piece_bytes` are cut (the tokenizer allows it: `piece_cutter`)."""
    units: List[Unit] = []
    for i, path in enumerate(corpus.files):
        size = os.path.getsize(path)
        if corpus.kind == "parquet":
            import pyarrow.parquet as pq
            meta = pq.ParquetFile(path).metadata
            units += [Unit(i, g, 1, meta.row_group(g).total_byte_size)
                      for g in range(meta.num_row_groups)]
        elif corpus.kind == "arrow":
            n = batch_count(path)
            units += [Unit(i, b, 1, size // max(n, 1)) for b in range(n)]
        elif size > piece_bytes and (corpus.kind == "text" and pieces or corpus.kind ==
                                      "jsonl" and not path.lower().endswith(".gz")):
            n = math.ceil(size / piece_bytes)  # a long .jsonl is cut between its lines
            units += [Unit(i, k, n, piece_bytes, piece_bytes) for k in range(n)]
        else:
            units.append(Unit(i, 0, 1, size))
    return units


def group_chunks(units: Sequence[Unit], processes: int,
                 max_bytes: Optional[int] = None) -> List[Tuple[Unit, ...]]:
    """Consecutive units in chunks of about total / (CHUNKS_PER_PROCESS x processes) bytes (the
    total read: at most data.max_bytes), at most CHUNK_MAX_BYTES (a unit larger than that is a
    chunk of its own)."""
    total = sum(u.nbytes for u in units)
    total = total if max_bytes is None else min(total, max_bytes)
    target = max(1, min(CHUNK_MAX_BYTES, total // (CHUNKS_PER_PROCESS * max(processes, 1))))
    chunks: List[Tuple[Unit, ...]] = []
    current: List[Unit] = []
    size = 0
    for unit in units:
        current.append(unit)
        size += unit.nbytes
        if size >= target:
            chunks.append(tuple(current))
            current, size = [], 0
    if current:
        chunks.append(tuple(current))
    return chunks


# ---- reading -------------------------------------------------------------------------------
def chunk_fragments(corpus: Corpus, chunk: Sequence[Unit], cutter: Any = None,
                    budget: Optional[int] = None) -> Iterator[Fragment]:
    """The fragments of a chunk in order, cut off after `budget` bytes of text (the part of
    data.max_bytes left when the chunk starts), exactly as `Corpus.documents` cuts. `cutter`:
    the pre-tokenizer that long text documents are cut by (`piece_cutter`)."""
    checker = None if cutter is None else cut_checker(cutter)
    return budgeted((f for unit in chunk for f in unit_fragments(corpus, unit, checker)),
                    budget)


def unit_fragments(corpus: Corpus, unit: Unit, checker: Any = None) -> Iterator[Fragment]:
    path = corpus.files[unit.file]
    if unit.parts > 1 and corpus.kind == "jsonl":
        for doc in corpus.file_documents(path, byte_range=_line_range(path, unit)):
            if doc:
                yield doc, True
        return
    if unit.parts > 1:
        yield from _piece(path, unit, checker)
        return
    for doc in corpus.file_documents(path, unit.part):
        if doc:
            yield doc, True


def _piece(path: str, unit: Unit, checker: Any) -> Iterator[Fragment]:
    """Piece `unit.part` of a long text file: from the first cut at or after its nominal start
    to the first cut at or after the next piece's; the last piece ends the document (its text
    may be empty when the previous piece's search ran to the end of the file)."""
    last = unit.part == unit.parts - 1
    with open(path, "rb") as f:
        start = find_cut(f, unit.part * unit.piece_bytes, checker)
        end = os.fstat(f.fileno()).st_size if last else \
            find_cut(f, (unit.part + 1) * unit.piece_bytes, checker)
        f.seek(start)
        raw = f.read(max(0, end - start))
    text = raw.decode("utf-8", errors="replace")  # cuts follow a newline: a character boundary
    if text or last:
        yield text, last


def _line_range(path: str, unit: Unit) -> Tuple[int, int]:
    """Part `unit.part` of a long .jsonl file: from the first line that starts at or after its
    nominal start to the first that starts at or after the next part's."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        bounds = [_line_start(f, k * unit.piece_bytes, size)
                  for k in (unit.part, unit.part + 1)]
    return bounds[0], size if unit.part == unit.parts - 1 else bounds[1]


def _line_start(f: Any, pos: int, size: int) -> int:
    if pos == 0:
        return 0
    f.seek(pos - 1)
    while True:
        buf = f.read(_SCAN)
        i = buf.find(b"\n")
        if i != -1:
            return f.tell() - len(buf) + i + 1
        if not buf:
            return size


def find_cut(f: Any, pos: int, checker: Any) -> int:
    """The first offset >= pos just after a newline that ends a line with text and before a
    printable ASCII byte, that the checker accepts (0 stays 0; none: the end of the file).
    Deterministic, so the piece that ends at a cut and the one that starts there agree."""
    if pos == 0:
        return 0
    size = os.fstat(f.fileno()).st_size
    offset = pos - 1  # a newline at pos - 1 cuts at pos
    while offset < size - 1:
        f.seek(offset)
        buf = f.read(_SCAN + 1)
        i = buf.find(b"\n")
        while i != -1 and i + 1 < len(buf):
            if 0x21 <= buf[i + 1] <= 0x7E and (i == 0 or buf[i - 1] not in _BLANKS) and \
                    (checker is None or checker(f, offset + i + 1)):
                return offset + i + 1
            i = buf.find(b"\n", i + 1)
        offset += max(len(buf) - 1, 1)  # overlap one byte: a newline ending buf pairs with the next
    return size


def cut_checker(pre_tokenizer: Any) -> Callable[[Any, int], bool]:
    """`(file, offset) -> bool`: whether the text around the offset, cut there, pre-tokenizes
    into exactly the pre-tokens it has whole (so BPE, which never merges across pre-tokens,
    gives the same ids). Both sides count: "\\n\\n" at the very end of a piece is one
    pre-token, but two before a letter."""
    def check(f: Any, offset: int) -> bool:
        here = f.tell()
        f.seek(max(0, offset - _WINDOW))
        left = f.read(offset - f.tell()).decode("utf-8", errors="replace")
        right = f.read(_WINDOW).decode("utf-8", errors="replace")
        f.seek(here)
        whole = pre_tokenizer.pre_tokenize_str(left + right)
        apart = pre_tokenizer.pre_tokenize_str(left) + [
            (t, (a + len(left), b + len(left))) for t, (a, b) in
            pre_tokenizer.pre_tokenize_str(right)]
        return whole == apart
    return check


def piece_cutter(hf_tokenizer: Any) -> Any:
    """The pre-tokenizer long documents are cut by, or None when the tokenizer does not allow
    pieces: a normalizer may depend on where the text starts (SentencePiece's "prepend ▁"),
    and without a pre-tokenizer BPE sees the whole document as one word."""
    if hf_tokenizer.normalizer is not None or hf_tokenizer.pre_tokenizer is None:
        return None
    return hf_tokenizer.pre_tokenizer
