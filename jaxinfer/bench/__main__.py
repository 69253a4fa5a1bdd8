import sys

from jaxinfer.bench.decode import main

sys.exit(main())
