from .cast import *
from .scaler import *
from .master import *
from .callback import *
