/* fragment: filled by the issue-4 work; inlined into the single files before landing */
