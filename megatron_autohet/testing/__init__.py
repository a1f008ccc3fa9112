"""Oracles and harnesses for tests and benchmarks; product code never imports this package.

reference      the single-process training every parallel layout must reproduce
stock          stock megatron-core (its own parallel state, DDP, optimizer, schedule): the
               runtime benchmark's baseline and a second oracle for homogeneous plans
exhaustive     an exhaustive planner, independent of the search's pruning: the optimality oracle
random_fleets  seeded random small fleets for the optimality checks
emulate        an emulated fleet of spot nodes on one machine (processes, notices, kills)
trace          spot traces (CSV) and their replay steps
s3_server      a real S3 endpoint: moto's HTTP server on 127.0.0.1 (tests, bench_spot)
doc_outputs    the docs' quoted command outputs checked against what the commands print today
"""
