"""The weight path: trainer -> master relay -> relay chain -> rollouts.

* ``manifest`` — a version as one flat buffer plus a manifest (name, dtype, shape, offset, CRC per
  tensor); pure planning helpers (layout, layout from (name, dtype, shape) specs, chunk bounds,
  the paper's optimal chunk count).
* ``transfer`` — one hop: chunked, resumable, received in place; the version store relays keep.
* ``chain`` — the manager's relay order and how it heals.
* ``publisher`` — the trainer's end: one copy into a host buffer, then a background push (torch
  is loaded only for a caller that hands it tensors: the emulated trainer describes its bytes).
* ``shared`` — a relay's shared-memory segment, mapped read-only and verified (no torch).
* ``tensors`` — flat buffer <-> named torch tensors (what engines load); the only torch here.
"""
