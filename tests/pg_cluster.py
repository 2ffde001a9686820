"""The throwaway PostgreSQL cluster of the run store's tests: agentrt/bench/pg_cluster.py (in the
package, so that `agentrt bench scale` starts one too)."""
from agentrt.bench.pg_cluster import USER, PostgresCluster, bin_dir

__all__ = ["USER", "PostgresCluster", "bin_dir"]
