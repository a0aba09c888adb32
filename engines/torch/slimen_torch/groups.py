"""Shared-prompt groups: rows of the KV cache that hold copies of one prompt's keys and values.

The samples of a request admitted together (GRPO's n samples of a prompt, or n requests of the
same prompt) hold the same prompt keys and values, so the batched Triton decode attention
(kernels.decode_attention's `shared`) reads them once, from a lead row, for groups of up to
SHARE_GROUP rows instead of once per row. A group forms when its rows are admitted (`form`) and
loses a row when the row finishes, stops or goes idle (`leave`): a leaving lead hands the group
to a member, whose own copy of the prompt is the same.
"""

from __future__ import annotations

import torch

SHARE_GROUP = 8  # rows a shared-prompt group holds at most (its queries: one product's rows)


class SharedPrompts:
    """The groups, as the decode attention reads them: grp[lead] lists a group's rows (-1 past
    them), plen[row] its shared length (0: in no group). The host keeps its own copies (grp_host,
    plen_host) and sends them to the device when a group changes."""

    def __init__(self, enabled: bool, *, slots: int, device):
        self.enabled = enabled  # off: rows are never grouped (each reads its own prompt)
        self.lead = [-1] * slots  # each row's group lead; -1: in no group
        self.n_grouped = 0  # rows in a group; none: the steps run without the shared pass
        self.grp_host = torch.full((slots, SHARE_GROUP), -1, dtype=torch.long)
        self.plen_host = torch.zeros(slots, dtype=torch.long)
        self.grp, self.plen = self.grp_host.to(device), self.plen_host.to(device)

    def form(self, keyed: list[tuple]) -> None:
        """Groups samples just admitted ((sequence.Sequence, key) pairs) whose rows hold copies
        of one prompt's keys and values (the same key), SHARE_GROUP rows a group at most."""
        by_key: dict[tuple, list] = {}
        for s, key in keyed:
            by_key.setdefault(key, []).append(s)
        changed = False
        for same in by_key.values():
            for i in range(0, len(same) - 1, SHARE_GROUP):
                rows = [s.slot for s in same[i:i + SHARE_GROUP]]
                if len(rows) < 2:
                    continue
                for r in rows:
                    self.lead[r] = rows[0]
                self.n_grouped += len(rows)
                self.grp_host[rows[0], :len(rows)] = torch.tensor(rows)
                self.plen_host[rows] = len(same[0].req.prompt)
                changed = True
        if changed:
            self._sync()

    def leave(self, rows: list[int]) -> None:
        """Takes rows out of their groups (an idle row overwrites its position 0): a group whose
        lead leaves passes to its first other member; a group left with one row ends."""
        changed = False
        for r in rows:
            lead = self.lead[r]
            if lead < 0:
                continue
            members = [m for m in self.grp_host[lead].tolist() if m >= 0 and m != r]
            self.grp_host[lead] = -1
            self.lead[r], self.plen_host[r] = -1, 0
            self.n_grouped -= 1
            if len(members) >= 2:
                for m in members:
                    self.lead[m] = members[0]
                self.grp_host[members[0], :len(members)] = torch.tensor(members)
            else:
                for m in members:
                    self.lead[m], self.plen_host[m] = -1, 0
                self.n_grouped -= len(members)
            changed = True
        if changed:
            self._sync()

    def _sync(self) -> None:
        # In stream order: a step already launched keeps the groups it was launched with.
        self.grp.copy_(self.grp_host)
        self.plen.copy_(self.plen_host)

    def active(self) -> bool:
        """Whether the next step runs the shared pass: grouping on and some row in a group."""
        return self.enabled and self.n_grouped > 0
