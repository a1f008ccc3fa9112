"""Layout-independent checkpoints: megatron-core torch_dist files, local-first, S3-backed.

Modules in data-flow order (what a step is, writing and uploading it, finding and loading it):

manifest        pure: the manifest that commits a step (files, per-chunk checksums), atomic writes
options         pure: the checkpoint flags of a job (--save, --load, --save-interval, ...)
state           what a rank's checkpoint holds, as megatron-core sharded state dicts
writer          one step: torch DCP files + common.pt + metadata.json, checksums, manifest, commit
failures        a failed save's root cause in one line, its traceback in a log file
deadline        a preemption notice's deadline: what a copy may still start before it
upload          the S3 tier of a save: main files, then the manifest once, then `latest`
inspect         pure: what a step holds and re-hashing its chunks (`autohet checkpoint ls/verify`)
convert         adopt a stock Megatron-LM torch_dist step: check it, copy it, write our manifest
sources         pure: the tiers a step is read from (own disk, peers, object store), one interface
lease           one live writer per location: a lease with a heartbeat (directory file, S3 object)
recovery_plan   pure: which saved chunks a rank of a new plan needs, and which tier serves each
loader          the regions a rank needs; megatron-core's dist_checkpointing.load of verified chunks
recovery        discover steps on every disk and in S3, fetch own/peers/S3, verify, stage, load
checkpointer    the training hook: resume at start, save every --save-interval (or in background)
s3_store        the S3 tier over boto3 (the only module importing boto3)
"""
