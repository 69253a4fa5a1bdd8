import sys

from jaxinfer.serve.server import main

sys.exit(main())
