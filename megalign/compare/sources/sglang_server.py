"""sglang dumper dumps of a server: the prefill and decode steps of several requests batched together,
lined up by request and position into [sequence, position, ...].

Inside a server the dumper's step is the forward pass: every pass (prefill, decode, mixed) writes,
besides what the model code dumps, its forward batch's core fields: `input_ids` and `positions`
(per token, the requests' tokens back to back), `seq_lens` (per request, its length so far, cached
prefix included) and `rids` (per request, its id). sglang's own comparator, and the dumps its tests
write, read `seq_lens` as each request's new tokens in the pass instead; new_tokens tells the two apart
by the pass's token count. The files record neither the pass's mode nor the prefix lengths, so
lengths so far cut requests by position: request i's tokens in a pass end at the token whose
position is seq_lens[i] - 1. A decode request gives one token, an extend request (a prefill, a chunk
of one, or the rest after a cached prefix) its new positions; (rid, position) names each token once.
A token met twice (a request's step dumped twice, or two requests' tokens swapped) must agree;
positions a cached prefix saved are absent from that request, and are taken from the request that
computed them only where the tokens before them are the same (a shared prefix).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from megalign.compare.sources.plain import load_pt
from megalign.compare.sources.sglang import dump_files, parse_filename, unwrap
from megalign.errors import UserError

CORE = ("input_ids", "positions", "seq_lens", "rids")


@dataclass
class Request:
    rid: str
    tokens: dict[int, int] = field(default_factory=dict)  # position -> token id
    where: dict[int, tuple[int, int]] = field(default_factory=dict)  # position -> (step, row in that pass)
    # (step, its index among the pass's requests, position) of its last token in every pass: where the
    # pass's per-request tensors (next-token logits) stand.
    ends: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class ServerDump:
    folder: Path
    requests: list[Request]  # in the order they first appear
    steps: dict[int, dict[str, object]]  # step -> name -> value (the files of rank 0)
    order: dict[str, int] = field(default_factory=dict)  # name -> its first dump_index: execution order

    def tokens(self) -> list[list[int]]:
        """Each request's tokens in position order (0 to its longest), where every position is known."""
        return [[r.tokens[p] for p in range(len(r.tokens))] for r in self.requests]

    def first(self, name: str) -> torch.Tensor:
        """The tensor `name` of the first pass that dumped it."""
        first = next((values[name] for values in self.steps.values() if name in values), None)
        if not isinstance(first, torch.Tensor):
            raise UserError(f"{self.folder}: no tensor {name!r} in any step")
        return first

    def lined_up(self, name: str) -> torch.Tensor:
        """The per-token tensor `name` of every pass ([tokens of the pass, ...]) as [sequence, position, ...],
        zero where a request has no such token."""
        first = self.first(name)
        width = max(len(r.tokens) for r in self.requests)
        out = first.new_zeros(len(self.requests), width, *first.shape[1:])
        for i, request in enumerate(self.requests):
            for position, (step, row) in request.where.items():
                value = self.steps[step].get(name)
                if not isinstance(value, torch.Tensor) or value.shape[0] <= row:
                    raise UserError(f"{self.folder}: step {step} has no row {row} of {name!r} for request "
                                    f"{request.rid} position {position}")
                out[i, position] = value[row]
        return out


    def at_ends(self, name: str) -> tuple[list[int], torch.Tensor]:
        """The per-request tensor `name` of every pass ([requests of the pass, ...]) at each request's last
        token in that pass: (those tokens' indexes among all real tokens, request after request; [rows, ...])."""
        index, rows, offset = [], [], 0
        for request in self.requests:
            for step, k, position in sorted(request.ends, key=lambda end: end[2]):
                value = self.steps[step].get(name)
                if not isinstance(value, torch.Tensor) or value.shape[0] <= k:
                    raise UserError(f"{self.folder}: step {step} has no row {k} of {name!r} for request "
                                    f"{request.rid} position {position}")
                index.append(offset + position)
                rows.append(value[k])
            offset += len(request.tokens)
        return index, torch.stack(rows)


def open_server_dump(folder: Path, rank: int = 0) -> ServerDump:
    """Read the core fields of every pass of `rank` and line the tokens up by request and position."""
    steps: dict[int, dict[str, object]] = defaultdict(dict)
    order: dict[str, int] = {}
    for file in dump_files(folder):
        fields = parse_filename(file)
        if fields["rank"] != rank:
            # Another rank's tensors (a TP server's shards) would go unread: their values never judged.
            raise UserError(f"{folder}: a server dump of several ranks ({file.name}): only one rank's are read")
        if fields["name"] in steps[fields["step"]]:  # which of the two to judge would be a guess
            raise UserError(f"{folder}: step {fields['step']} dumped {fields['name']!r} twice")
        steps[fields["step"]][fields["name"]] = unwrap(load_pt(file))[0]
        order[fields["name"]] = min(order.get(fields["name"], fields["dump_index"]), fields["dump_index"])
    steps = {s: v for s, v in steps.items() if all(k in v for k in CORE)}
    if not steps:
        raise UserError(f"{folder}: no pass with all of {', '.join(CORE)} (a server's dumper writes them every "
                        "forward pass)")
    requests: dict[str, Request] = {}
    for step in sorted(steps):
        _cut(folder, step, steps[step], requests)
    return ServerDump(folder=Path(folder), requests=list(requests.values()), steps=steps, order=order)


def _cut(folder: Path, step: int, values: dict, requests: dict[str, Request]) -> None:
    """Give each token of one pass to its request (new_tokens says where each request's run ends)."""
    ids, positions, lengths, rids = (values[k] for k in CORE)
    vectors = (ids, positions, lengths)
    if not (all(isinstance(v, torch.Tensor) and v.ndim == 1 and not v.is_floating_point() for v in vectors)
            and isinstance(rids, list) and ids.shape == positions.shape and len(rids) == lengths.numel()):
        raise UserError(f"{folder}: step {step}: input_ids, positions, seq_lens and rids do not fit together")
    counts = new_tokens(lengths.tolist(), ids.numel())
    row = 0
    for index, (rid, length) in enumerate(zip(rids, lengths.tolist())):
        request = requests.setdefault(str(rid), Request(rid=str(rid)))
        end = None if counts is None else row + length
        while True:
            if row >= ids.numel():
                raise UserError(f"{folder}: step {step}: request {rid}'s tokens end before position {length - 1}")
            position, token = int(positions[row]), int(ids[row])
            known = request.tokens.get(position)
            if known is not None and known != token:
                raise UserError(f"{folder}: step {step}: request {rid} position {position} holds token {token}, "
                                f"an earlier step {known}")
            request.tokens[position] = token
            request.where[position] = (step, row)
            row += 1
            if row == end or (end is None and position == length - 1):
                break
        request.ends.append((step, index, position))
    if row != ids.numel():
        raise UserError(f"{folder}: step {step}: {ids.numel() - row} tokens after the last request's")


def new_tokens(seq_lens: list[int], tokens: int) -> Optional[list[int]]:
    """`seq_lens` as each request's new tokens in the pass, where they are: sglang's comparator reads them
    so (its token aligner cuts a pass's tokens by them), a server's forward batch holds each request's
    length so far. The dump says which: a length so far is at least the request's new tokens, so lengths
    that add up to the pass's tokens are its new tokens under either meaning; others are lengths so far,
    and the runs are cut where a request's position reaches its length - 1. None: lengths so far."""
    return seq_lens if sum(seq_lens) == tokens and all(n > 0 for n in seq_lens) else None


def fill_prefixes(dump: ServerDump) -> Optional[str]:
    """Positions a cached prefix saved a request, taken from the requests that computed them (the radix
    cache matched those tokens): None when every request is whole after it, else why one is not."""
    for request in dump.requests:
        missing = [p for p in range(max(request.tokens) + 1) if p not in request.tokens]
        if not missing:
            continue
        donors = [d for d in dump.requests if d is not request and all(p in d.tokens for p in missing)]
        found = {tuple(d.tokens[p] for p in missing) for d in donors}
        if len(found) != 1:
            why = "no request computed them" if not found else "the requests that computed them hold other tokens"
            return f"request {request.rid}: positions {missing[0]}-{missing[-1]} were not computed for it; {why}"
        for p in missing:
            request.tokens[p], request.where[p] = donors[0].tokens[p], donors[0].where[p]
    return None
