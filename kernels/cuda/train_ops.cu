// train_ops: see train_launch.h (work in progress).
#include "kernels/cuda/train_launch.h"
