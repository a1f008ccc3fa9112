"""Layout-independent checkpoints: megatron-core torch_dist files, local-first, S3-backed.

Modules in data-flow order (what a step is, writing it, finding and loading it):

manifest        pure: the manifest that commits a step (files, per-chunk SHA-256), atomic writes
options         pure: the checkpoint flags of a job (--save, --load, --save-interval, ...)
state           what a rank's checkpoint holds, as megatron-core sharded state dicts
writer          one step: torch DCP files + common.pt + metadata.json, checksums, manifest, commit
recovery_plan   pure: which saved chunks a rank of a new plan needs
loader          verify the needed chunks, then megatron-core's dist_checkpointing.load
checkpointer    the training hook: resume at start, save every --save-interval
s3_store        the S3 tier over boto3 (the only module importing boto3)
"""
