"""The data: corpora on disk (dataset, download), the generated reasoning corpora (synthetic), the tokenizer and the
distributed loader that turns text into batches."""
