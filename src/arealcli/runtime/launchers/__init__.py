"""Multi-node launchers of `areal train --launcher slurm|ray`: a plan of what runs on which node
(`plan`), a Slurm batch script (`slurm`), Ray actors in a placement group (`ray`), the wait for servers
to answer (`health`), and the cluster run itself (`start`: dry run, the run directory prepared as a
local run's, submit, follow). Each starts the generation servers of `cluster.allocation` on their nodes
and `areal train --nnodes K --node-rank r` on each trainer node (torch's elastic agent and its
rendezvous, as on one machine).

Layer 7 of runtime/__init__.py's table: it imports only folders of lower layers."""
