// Validates an Amazon States Language definition (read from stdin) with AWS's own language
// service, amazon-states-language-service (the validator behind the AWS Toolkit's and Workflow
// Studio's ASL editing): JSON schema of every state type, transitions to existing states,
// unreachable states, and JSONPath / intrinsic-function syntax in ".$" fields.
// Prints one JSON line per diagnostic and exits 1 when there is any.
"use strict";
const { getLanguageService, TextDocument } = require("amazon-states-language-service");
const fs = require("fs");

const text = fs.readFileSync(0, "utf8");
const service = getLanguageService({});
const document = TextDocument.create("file:///definition.asl.json", "json", 0, text);
service
  .doValidation(document, service.parseJSONDocument(document), {
    comments: "error",
    trailingCommas: "error",
  })
  .then((diagnostics) => {
    for (const d of diagnostics) {
      const start = document.offsetAt(d.range.start);
      const at = text.substring(start, start + 100).replace(/\s+/g, " ");
      console.log(JSON.stringify({ severity: d.severity, message: d.message, at }));
    }
    process.exit(diagnostics.length ? 1 : 0);
  });
