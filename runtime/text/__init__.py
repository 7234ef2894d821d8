"""Text in and out: tokenizer and chat template, prompt encoding, incremental detokenization."""
