from .cast import *
from .scaler import *
from .master import *
from .distributed import *
from .mixed_fit import *
from .callback import *
from .checkpoint import *
from .learner import *
