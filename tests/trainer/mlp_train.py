"""A user's plain-torch loop, dumped with megalign's one line, for the two-run zoom recipe:

    MEGALIGN_DUMP=dumps/a MEGALIGN_STATS_ONLY=1 python tests/trainer/mlp_train.py
    MEGALIGN_DUMP=dumps/b MEGALIGN_STATS_ONLY=1 python tests/trainer/mlp_train.py --bug
    megalign compare dumps/a dumps/b          # diverges, and says which MEGALIGN_DUMP_ONLY to zoom with
    MEGALIGN_DUMP=dumps/a-zoom MEGALIGN_DUMP_ONLY='1:...' python tests/trainer/mlp_train.py
    MEGALIGN_DUMP=dumps/b-zoom MEGALIGN_DUMP_ONLY='1:...' python tests/trainer/mlp_train.py --bug
    megalign compare dumps/a-zoom dumps/b-zoom

A 6-layer tanh MLP, SGD, three steps, each on its own seeded batch. The planted bug, `--bug`: layer 4's
learning rate doubled, an optimizer's per-group setting gone wrong; step 0 is unchanged, step 1 runs
layer 4 with other weights.
"""

import argparse
from typing import Optional

import torch

import megalign

WIDTH, DEPTH, STEPS, BUGGY_LAYER = 32, 6, 3, 4


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = MLP()
    buggy = model.layers[BUGGY_LAYER].parameters()
    rest = [p for i, layer in enumerate(model.layers) if i != BUGGY_LAYER for p in layer.parameters()]
    optimizer = torch.optim.SGD([{"params": rest}, {"params": buggy, "lr": 0.2 if args.bug else 0.1}], lr=0.1)
    with megalign.Dumper.from_env() as dumper:
        dumper.watch(model)
        for step in range(STEPS):
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
            with dumper.step(step):
                loss = model(x).square().mean()
                dumper.add("loss", "loss", loss.detach())
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
