"""Training data: a corpus the project builds itself, read through megatron-core's GPTDataset.

``corpus`` writes a megatron-core indexed dataset (.bin/.idx) from text already on the machine;
``batches`` reads any such dataset with ``GPTDataset`` and cuts deterministic global batches in
the runtime's contract (dict of tokens/labels/loss_mask/position_ids, [global_batch_size, seq]),
from the built-in corpus or Megatron-LM's dataset flags (blends, per-split blends); ``indexed``
checks the user's dataset prefixes before any process starts (megatron-core's index reader);
``vocabulary`` checks Megatron-LM's tokenizer flags against the model's vocabulary.
"""
