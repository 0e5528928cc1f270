"""python -m medusa_heads.cli: the medusa-heads command (accelerate launch ... -m medusa_heads.cli train ...)."""
from medusa_heads.cli import main

main()
