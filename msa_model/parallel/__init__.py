"""What the model's layers do across ranks: context-parallel slicing and gathers
(`context_parallel`) and the attention layers' TP/CP gradient adjustments (`grads`)."""
