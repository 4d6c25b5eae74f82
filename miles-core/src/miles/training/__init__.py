"""Training: the trainer interface that backends (miles-fsdp, miles-megatron) implement, and the batch
it trains on."""
