"""What the tests share: the tiny models and data they train on (`tiny_assets`, `tiny_families`, `tiny_mm_assets`,
`media_files`), runs of the real `relax` command (`runs`), rewards and environments that runs load by dotted path
(`e2e_rewards`, `e2e_envs`), HTTP servers on 127.0.0.1 (`http_servers`), and the fault injection loaded into a
child process (`fault_injection/sitecustomize.py`)."""
