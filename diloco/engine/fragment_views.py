"""What an engine's fragments show together: each one's position (rounds, next syncs, exchanges in
flight) and the global model over all of them (parameters, names, sizes, hashes, the global state
dict). Read-only views that ``DiLoCo`` inherits; the state itself is each ``Fragment``'s."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from compress.fingerprint_parts import finish
from diloco.engine.fragment import Fragment, InFlight
from diloco.engine.outer_state import global_weights_loaded, params_hash
from diloco.engine.sharded import ShardedState


class FragmentViews:
    """Views over ``fragments`` (in order) of ``model``; ``sharded``: the model's sharding in the
    group (None: unsharded)."""

    fragments: list[Fragment]
    model: nn.Module
    sharded: ShardedState | None
    _global_hash: str | None = None  # ``global_hash()`` of the global parameters as they are (None: not taken)

    # --- each fragment's position ---------------------------------------------------------------

    @property
    def rounds(self) -> list[int]:
        """Each fragment's exchanges launched so far."""
        return [f.round for f in self.fragments]

    @property
    def next_sync(self) -> list[int]:
        """The inner step at which each fragment syncs next (``NEVER``: when its time round ends)."""
        return [f.next_sync for f in self.fragments]

    @property
    def in_flight(self) -> list[InFlight | None]:
        """Each fragment's exchange in flight, or None."""
        return [f.in_flight for f in self.fragments]

    # --- the global model -----------------------------------------------------------------------

    @property
    def global_params(self) -> list[torch.Tensor]:
        """The fp32 global parameters, in fragment order."""
        return [g for f in self.fragments for g in f.global_params]

    @property
    def local_params(self) -> list[torch.Tensor]:
        """The model's trainable parameters, in fragment order (DTensors when sharded)."""
        return [p for f in self.fragments for p in f.local_params]

    @property
    def names(self) -> list[str]:
        return [n for f in self.fragments for n in f.names]

    @property
    def numel(self) -> int:
        """Trainable parameters (elements) the engine syncs (of the whole model when sharded)."""
        return sum(f.numel for f in self.fragments)

    @property
    def local_numel(self) -> int:
        """Elements this rank's global copy holds (``numel`` unless sharded)."""
        return sum(f.local_numel for f in self.fragments)

    @property
    def round(self) -> int:
        """Fragment syncs launched so far, over all fragments (the rounds with one fragment)."""
        return sum(f.round for f in self.fragments)

    def pseudo_gradient(self) -> torch.Tensor:
        """Flat fp32 ``θ_global − θ_local`` of every fragment, on the global copy's device (this
        rank's shards, concatenated, when sharded)."""
        return torch.cat([f.pseudo_gradient() for f in self.fragments])

    def global_hash(self) -> str:
        """`params_hash` of the global parameters, in fragment order (16 hex chars), taken once per
        change of them (the engine's ``_changed``): a round's report after its commit and the next
        quorum ask share one pass. Sharded: of the whole model (every rank's shard), the same number
        as unsharded for the same values, computed collectively at each change, so calling it needs
        no collective."""
        if self.sharded is not None:
            return self.sharded.hash
        if self._global_hash is None:
            if all(g.device.type == "cpu" for g in self.global_params):
                # each fragment's part, folded into its last outer step's pass where it was streamed
                parts = sum(f.hash_part() for f in self.fragments)
                self._global_hash = f"{finish(parts, [g.numel() for g in self.global_params]):016x}"
            else:  # on a GPU the whole sum stays there and is read once
                self._global_hash = params_hash(self.global_params)
        return self._global_hash

    def fragment_hash(self, p: int) -> str:
        """`params_hash` of fragment p's global parameters (this rank's shard when sharded)."""
        return params_hash(self.fragments[p].global_params)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The global (outer) parameters by name, fp32: what is evaluated and saved (sharded:
        DTensors laid out like the model's parameters)."""
        if self.sharded is not None:
            return self.sharded.global_state_dict(self.fragments)
        return {n: g.detach().clone() for f in self.fragments for n, g in zip(f.names, f.global_params)}

    def global_weights(self) -> contextlib.AbstractContextManager[nn.Module]:
        """Temporarily load the global parameters into the model (e.g. for eval)."""
        return global_weights_loaded(self.model, self.global_params, [v for f in self.fragments for v in f.local_views()])
