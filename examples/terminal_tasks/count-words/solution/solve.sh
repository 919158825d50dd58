#!/bin/bash
cat /app/notes/*.txt | wc -w > /app/words.txt
