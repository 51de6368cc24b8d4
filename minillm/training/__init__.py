"""How the bundled models were made: the corpus, the training script and the model cards."""
