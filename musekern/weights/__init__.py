"""FP8 weights for the attention front (issue 30, part 1; pure CPU/torch, no kernels): formats.py reads which
checkpoint format a config announces (no torch), pack.py packs one tensor-parallel rank's q | k | v | gate into the
canonical device layout the kernels read (torch, imported there)."""
