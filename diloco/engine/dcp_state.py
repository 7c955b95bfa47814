"""The engine's state as a ``torch.distributed.checkpoint`` (DCP) state dict, and back.

``engine.state_dict()`` holds this rank's tensors as flat vectors (with a sharded model: its
shards). For DCP every tensor becomes one entry shaped like its parameter: a DTensor sharded like
the model's parameter when the model is sharded, a plain tensor otherwise; fragment-long vectors
(an exchange's landed mean, eager's own previous Δ, an error-feedback residual) are cut per
parameter the same way. The rest (counters, the outer optimizer's hyperparameters, which
optional entries exist) is plain JSON. Because every tensor is saved with its global shape, DCP
loads it into a template of another layout: a checkpoint taken with 4 ranks per group resumes
on 2 (or unsharded) with exactly the same values.

``to_dcp(engine)`` -> (tensors, meta); ``template(engine, meta)`` -> tensors shaped for this
engine to load into; ``from_dcp(engine, tensors, meta)`` -> what ``engine.load_state_dict`` takes.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco.engine.outer_state import OuterFragment

FORMAT = "diloco-engine-dcp"
VERSION = 1
_FLAT = ("in_flight", "own_previous", "residual")  # fragment-long vectors, cut per parameter


class DcpStateError(ValueError):
    """A DCP engine state that does not fit this engine (the message says what differs)."""


def _like(frag: OuterFragment, i: int, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part of parameter i of ``frag``) as the checkpoint's entry."""
    from torch.distributed.tensor import DTensor

    p = frag.local_params[i]
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _split(frag: OuterFragment, flat: torch.Tensor) -> list[torch.Tensor]:
    out, at = [], 0
    for g in frag.global_params:
        out.append(flat[at:at + g.numel()].view_as(g))
        at += g.numel()
    return out


def to_dcp(engine: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's engine state as DCP entries (``engine/f<p>/...``) and its JSON metadata."""
    state = engine.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    frags = []
    for p, (frag, saved) in enumerate(zip(engine.fragments, state["fragments"])):
        key = f"engine/f{p}"
        for i, name in enumerate(frag.names):
            tensors[f"{key}/global/{name}"] = _like(frag, i, saved["global"][name])
        outer = saved["outer_optimizer"]
        kinds: dict[str, dict[str, Any]] = {}
        for index, per_param in outer["state"].items():
            i = int(index)
            kinds[str(i)] = {}
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor) and v.shape == frag.global_params[i].shape and v.dim() > 0:
                    tensors[f"{key}/outer/{i}/{k}"] = _like(frag, i, v)
                    kinds[str(i)][k] = "tensor"
                elif isinstance(v, torch.Tensor) and v.dim() == 0:  # e.g. Adam's step: the same on every rank
                    tensors[f"{key}/outer/{i}/{k}"] = v.detach().clone()
                    kinds[str(i)][k] = f"scalar:{str(v.dtype).removeprefix('torch.')}"
                else:
                    kinds[str(i)][k] = {"value": v}
        present = {}
        for what in _FLAT:
            vec = saved[what]["mean"] if what == "in_flight" and saved[what] is not None else saved[what]
            present[what] = vec is not None
            if vec is not None:
                for i, (name, piece) in enumerate(zip(frag.names, _split(frag, vec))):
                    tensors[f"{key}/{what}/{name}"] = _like(frag, i, piece.clone())
        flight = saved["in_flight"]
        frags.append({"names": frag.names, "round": saved["round"], "next_sync": saved["next_sync"],
                      "launched_at": saved["launched_at"], "present": present, "outer_kinds": kinds,
                      "in_flight": None if flight is None else {"round": flight["round"], "apply_at": flight["apply_at"]},
                      "param_groups": outer["param_groups"]})
    meta = {"format": FORMAT, "version": VERSION, "engine_version": state["version"], "mode": state["mode"],
            "inner_step": state["inner_step"], "finished": state["finished"], "fragments": frags,
            "sharded": engine.sharded is not None, "schedule": state.get("schedule")}
    return tensors, meta


def _check(engine: Any, meta: dict[str, Any]) -> None:
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DcpStateError(f"not a {FORMAT} version {VERSION} state: {meta.get('format')!r} {meta.get('version')!r}")
    if meta["mode"] != engine.mode:
        raise DcpStateError(f"the checkpoint's engine ran mode {meta['mode']!r}, this one runs {engine.mode!r}")
    if [f["names"] for f in meta["fragments"]] != [f.names for f in engine.fragments]:
        raise DcpStateError("the checkpoint has other fragments (parameter names) than this engine")


def template(engine: Any, meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Zeroed entries laid out for this engine (its mesh, its shards) that DCP loads ``meta``'s
    checkpoint into, whatever layout it was saved from."""
    _check(engine, meta)
    out: dict[str, torch.Tensor] = {}
    for p, (frag, saved) in enumerate(zip(engine.fragments, meta["fragments"])):
        key = f"engine/f{p}"
        for i, (name, g) in enumerate(zip(frag.names, frag.global_params)):
            out[f"{key}/global/{name}"] = _like(frag, i, torch.zeros_like(g))
            for what in _FLAT:
                if saved["present"][what]:
                    out[f"{key}/{what}/{name}"] = _like(frag, i, torch.zeros_like(g))
        for index, kinds in saved["outer_kinds"].items():
            i = int(index)
            for k, kind in kinds.items():
                if kind == "tensor":
                    out[f"{key}/outer/{i}/{k}"] = _like(frag, i, torch.zeros_like(frag.global_params[i]))
                elif isinstance(kind, str) and kind.startswith("scalar:"):
                    dtype = getattr(torch, kind.removeprefix("scalar:"), None)
                    if not isinstance(dtype, torch.dtype):
                        raise DcpStateError(f"outer state {k!r} of parameter {i}: unknown dtype {kind!r}")
                    out[f"{key}/outer/{i}/{k}"] = torch.zeros((), dtype=dtype)
    return out


def from_dcp(engine: Any, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """The ``engine.load_state_dict`` state from loaded entries (``template``'s, filled) and meta."""
    from torch.distributed.tensor import DTensor

    _check(engine, meta)

    def local(name: str) -> torch.Tensor:
        t = tensors[name]
        return (t.to_local() if isinstance(t, DTensor) else t).detach()

    frags = []
    for p, (frag, saved) in enumerate(zip(engine.fragments, meta["fragments"])):
        key = f"engine/f{p}"
        state: dict[str, Any] = {}
        for index, kinds in saved["outer_kinds"].items():
            i = int(index)
            state[i] = {k: (kind["value"] if isinstance(kind, dict) else local(f"{key}/outer/{i}/{k}").clone())
                        for k, kind in kinds.items()}
        flat = {what: (torch.cat([local(f"{key}/{what}/{n}").reshape(-1) for n in frag.names])
                       if saved["present"][what] else None) for what in _FLAT}
        flight = saved["in_flight"]
        frags.append({
            "global": {n: local(f"{key}/global/{n}").clone() for n in frag.names},
            "outer_optimizer": {"state": state, "param_groups": saved["param_groups"]},
            "names": list(frag.names), "round": saved["round"], "next_sync": saved["next_sync"],
            "launched_at": saved["launched_at"],
            "in_flight": None if flight is None else {"mean": flat["in_flight"], "round": flight["round"],
                                                      "apply_at": flight["apply_at"]},
            "own_previous": flat["own_previous"], "residual": flat["residual"],
        })
    return {"version": meta["engine_version"], "mode": meta["mode"], "inner_step": meta["inner_step"],
            "finished": meta["finished"], "fragments": frags, "schedule": meta.get("schedule")}
