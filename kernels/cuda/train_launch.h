#pragma once
// Transitional (issue 19): the drafter's launchers now live in their op-family headers.
#include "kernels/cuda/launch.h"
