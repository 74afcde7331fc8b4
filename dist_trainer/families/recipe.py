"""How one of this model's tensors is read out of a Hugging Face tensor, and back (torch-free arithmetic).

Conventions converted exactly (a permutation, a slice or a transpose, never an approximation):

- transposed storage: GPT-2's ``Conv1D`` linears hold (in, out); ours are (out, in);
- fused tensors: GPT-2's ``c_attn`` (q, k, v side by side along the output features), Phi-3's ``qkv_proj`` and
  ``gate_up_proj`` (blocks one after the other: ``offset``, ``rows``), GPT-NeoX's ``query_key_value`` (interleaved
  per head, [q_h; k_h; v_h] blocks of 3 * head_dim rows: ``period``);
- RoPE row order: Hugging Face rotates ``rotate_half`` pairs (i, i + R/2) of the first R = ``rope_dims`` rows of
  each head, ours adjacent pairs (2i, 2i + 1): within each ``rope_head_dim`` block of q and k, our row 2i is HF's
  row i and our row 2i + 1 is HF's row i + R/2 (transformers' ``convert_llama_weights_to_hf.py`` inverted), the
  rows past R unchanged, so the scores q.k are the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    """Our tensor = HF tensor ``hf_name`` (transposed when ``transpose``), its rows cut as below, each
    ``rope_head_dim`` block of rows permuted from rotate_half order (its first ``rope_dims`` rows; 0 = all).

    Rows: with neither ``offset`` nor ``period``, all of them. With ``offset`` (and ``rows``), rows
    [offset, offset + rows) of the (transposed) HF tensor: a block of a fused tensor. With ``period`` too, the HF
    rows are blocks of ``period`` rows and ours are rows [offset, offset + rows) of every block, in block order
    (GPT-NeoX's per-head q/k/v)."""

    hf_name: str
    transpose: bool = False
    offset: int | None = None  # where ours start in the (transposed) HF rows, or in each period block
    rows: int | None = None  # how many: in all (no period) or per period block
    rope_head_dim: int = 0  # q/k rows in rotate_half order, per head of this many rows; 0 = no permutation
    period: int = 0  # rows of one interleaved block of the fused HF tensor; 0 = one block (not interleaved)
    rope_dims: int = 0  # partial rotary: rows of each head the permutation covers; 0 = all rope_head_dim

    def __post_init__(self) -> None:
        if (self.offset is None) != (self.rows is None):
            raise ValueError(f"Recipe({self.hf_name!r}): offset and rows go together")
        if self.period and (self.offset is None or self.rows is None or self.offset + self.rows > self.period):
            raise ValueError(f"Recipe({self.hf_name!r}): period={self.period} needs offset + rows within it")
        if self.rope_dims and (not self.rope_head_dim or self.rope_dims % 2 or self.rope_dims > self.rope_head_dim):
            raise ValueError(f"Recipe({self.hf_name!r}): rope_dims={self.rope_dims} must be even and at most "
                             f"rope_head_dim={self.rope_head_dim}")

    @property
    def fused(self) -> bool:
        """Whether the HF tensor holds more than this one of ours."""
        return self.offset is not None

    def our_rows(self, hf_rows: int) -> int:
        """Rows of our tensor when the (transposed) HF tensor has ``hf_rows`` rows."""
        if self.offset is None or self.rows is None:
            return hf_rows
        if not self.period:
            return self.rows
        if hf_rows % self.period:
            raise ValueError(f"{self.hf_name}: {hf_rows} rows are not whole blocks of period {self.period}")
        return hf_rows // self.period * self.rows

    def hf_row_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The (transposed) HF row ranges, in order, that hold our rows [start, stop): one range, or one per
        period block touched (a TP rank reads only the rows it owns)."""
        if self.offset is None or self.rows is None:
            return [(start, stop)] if stop > start else []
        if not self.period:
            return [(self.offset + start, self.offset + stop)] if stop > start else []
        out = []
        row = start
        while row < stop:
            block, within = divmod(row, self.rows)
            take = min(self.rows - within, stop - row)
            first = block * self.period + self.offset + within
            out.append((first, first + take))
            row += take
        return out

    def rope_span(self) -> tuple[int, int]:
        """(head rows, permuted rows of each head): (0, 0) when no permutation."""
        return self.rope_head_dim, self.rope_dims or self.rope_head_dim
