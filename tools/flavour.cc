// Which of the two CLI executables this is (tools/commands.h, WithTorch). The only source
// compiled twice for that reason alone.
#include "tools/commands.h"

namespace flywheel::tools {

#ifdef FLYWHEEL_WITH_TORCH
bool WithTorch() { return true; }
#else
bool WithTorch() { return false; }
#endif

}  // namespace flywheel::tools
