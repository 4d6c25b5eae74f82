"""The ``diffusion`` trainer: FSDP2 over the policy transformer, trained on recorded denoising steps."""
