/* dion3/export.h — DION3_API marks the public API. The shared library is compiled with hidden
 * visibility, so what carries this mark is all it exports; internals stay out of its symbol
 * table and cannot clash with a consumer's own symbols. */
#ifndef DION3_EXPORT_H
#define DION3_EXPORT_H

/* DION3_LOCAL: a private member type of an exported class (its nested types would otherwise
 * share the class's visibility). */
#if defined(__GNUC__) || defined(__clang__)
#define DION3_API __attribute__((visibility("default")))
#define DION3_LOCAL __attribute__((visibility("hidden")))
#else
#define DION3_API
#define DION3_LOCAL
#endif

#endif /* DION3_EXPORT_H */
