"""Data pipeline: corpus -> tokenizer -> token shards -> sampled, collated batches.

corpus.py   find and read documents (files, folders, JSONL; the stdlib as the default corpus)
prepare.py  `dist-trainer prepare`: train the byte-level BPE (bpe.py) or take a model's HF tokenizer, write
            shards + meta.json atomically (folder.py: the output folder, checked, reused, published)
chat.py     `prepare --chat`: conversations rendered by the folder's chat template (chat_template.py), packed
            into windows with the tokens the loss covers; ChatDataset
tokenizer.py HF tokenizer folders: BOS/EOS from tokenizer_config.json, the vocabulary hash, check_data_tokenizer
shards.py   parallel encoding and the shard writer
dataset.py  the on-disk format, TokenDataset (memmapped windows), checksums (in full once per folder
            state, recorded in verified.json), load_tokenizer
sampler.py  GlobalBatchSampler: the step -> sample indices map, the same for every DP layout
mixture.py  data.sources: weighted mixtures of prepared folders, MixtureSampler (the same per (seed, step) in
            every layout), MixtureDataset (the folders as one index space)
batch.py    collate: causal shift or BERT masking (mask_tokens); collate_chat: the covered targets, conversations

Nothing is imported here, so `import dist_trainer.data.prepare` stays free of torch.
"""
