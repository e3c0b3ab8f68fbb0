"""What engine, mocker and router share: model files, tokenizer, block hashing."""
