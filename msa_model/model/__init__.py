"""The network: the GPT model built from a ModelConfig (`gpt`), its attention layers (`attention`:
MSA and the dense baseline), the routed experts (`experts`) and the dense MLPs (`mlp`)."""
