"""HuggingFace Trainer with DDP on a tiny GPT-2 built in code (no downloads), as under torchrun."""

import argparse
import os

import torch
import torch.distributed as dist


class Tokens(torch.utils.data.Dataset):
    """Deterministic token sequences: the same on every run and every rank."""

    def __init__(self, count: int, length: int, vocab: int):
        g = torch.Generator().manual_seed(11)
        self.ids = torch.randint(0, vocab, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out-hf_trainer")
    args = parser.parse_args()
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(output_dir=os.path.join(args.out, "trainer"), max_steps=6,
                                 per_device_train_batch_size=4, learning_rate=1e-3, seed=0, use_cpu=True,
                                 ddp_backend="gloo", report_to=[], save_strategy="no", logging_steps=2,
                                 dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(96, 16, 64))
    result = trainer.train()
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"rank {rank} world {dist.get_world_size() if dist.is_initialized() else 1} "
          f"steps {result.global_step} loss {result.training_loss:.6f}")
    os.makedirs(args.out, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               os.path.join(args.out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
