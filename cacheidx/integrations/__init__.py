"""Other libraries' models served through the index. Nothing here is imported until asked
for: ``from cacheidx.integrations import transformers`` needs transformers and torch."""
