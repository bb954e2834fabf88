/* The draw of sampler.c, for the C code that draws without a round trip through Python. */

#ifndef KZ_SAMPLER_H
#define KZ_SAMPLER_H

#include <stdint.h>

int64_t kz_sampler_draw(const float *logits, int64_t n, double temperature, int64_t top_k, double top_p,
                        double u);

#endif
