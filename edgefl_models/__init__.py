"""CPU-sized architectures, datasets and partitioners, shared by both sides."""
