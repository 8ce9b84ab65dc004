"""One rank of a data-parallel training run, started by mlx.launch from test_train.py.

    mlx.launch -n 2 python tests/distributed_worker.py MODEL_DIR PIECES.npz VOCAB.npy OUT_DIR
"""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_eagle import load  # noqa: E402
from mlx_eagle.heads import new_head  # noqa: E402
from mlx_eagle.train import TrainConfig, Trainer, d2t_t2d  # noqa: E402


def main(model_dir: str, pieces: str, vocab: str, out: str) -> None:
    group = mx.distributed.init()
    model, _ = load(model_dir)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 12
    used = np.load(vocab)
    head = new_head(model, "eagle3", draft_vocab_size=len(used), seed=1)
    head.d2t = mx.array(d2t_t2d(used, model.args.vocab_size)[0])
    config = TrainConfig(steps=20, tokens_per_batch=256, lr=3e-3, warmup=3, ttt_steps=2, checkpoint_every=1000)
    with np.load(pieces) as saved:  # answers after token 4, as in test_train's fixture
        sequences = [(saved[key], np.arange(len(saved[key])) >= 4) for key in saved.files]
    trainer = Trainer(model, head, sequences, config, Path(out) / f"work{group.rank()}",
                      used=used, progress=False)
    trainer.run()
    weights = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(Path(out) / f"rank{group.rank()}-of-{group.size()}.safetensors"), weights)


if __name__ == "__main__":
    main(*sys.argv[1:5])
